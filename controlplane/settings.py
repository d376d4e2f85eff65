"""Settings, read from the environment only. Every variable is documented in docs/reference/environment.md.

Features turn on when their variable is present: DATABASE_URL (else embedded SQLite),
REDIS_URL (else an embedded filesystem broker for Celery and the database for heartbeats).
"""

import os
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_SECRET_KEY = "dev-insecure-unbroken-secret-key-change-me"


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() == "true":
        return True
    if raw.lower() == "false":
        return False
    raise ImproperlyConfigured(f"{name}={raw!r}: use true or false")


def env_secret(name: str, default: str = "") -> str:
    """A secret from NAME, or from the file named by NAME_FILE (a mounted Kubernetes secret)."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(name, default)


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r}: must be a number") from None


DEBUG = env_bool("UNBROKEN_DEBUG", False)
SECRET_KEY = env_secret("UNBROKEN_SECRET_KEY", DEFAULT_SECRET_KEY)
if not DEBUG and SECRET_KEY == DEFAULT_SECRET_KEY:
    raise ImproperlyConfigured(
        "UNBROKEN_SECRET_KEY is the default while UNBROKEN_DEBUG is false: set UNBROKEN_SECRET_KEY "
        "(or UNBROKEN_SECRET_KEY_FILE) to a long random value. `make up` does this for you."
    )
ALLOWED_HOSTS = [h for h in os.environ.get("UNBROKEN_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in os.environ.get("UNBROKEN_CSRF_TRUSTED_ORIGINS", "").split(",") if o]
DATA_DIR = Path(os.environ.get("UNBROKEN_DATA_DIR", BASE_DIR / "var"))
# The account local jobs run as when the control plane runs as root (docs/guides/security.md): the job
# cannot read the secret key file or the SQLite database. "root" keeps jobs at the control plane's rights;
# unset: "nobody" where it can run this Python, else root with a warning (launchers/isolation.py).
JOB_USER = os.environ.get("UNBROKEN_JOB_USER", "")
# /metrics without its token: clients from these networks (the connection's address; comma-separated CIDRs).
METRICS_ALLOW_NETWORKS = [n.strip() for n in os.environ.get(
    "UNBROKEN_METRICS_ALLOW_NETWORKS", "127.0.0.0/8,::1/128").split(",") if n.strip()]
# Where trainers reach the ingest API (the local launcher passes it to the processes it starts).
PUBLIC_URL = os.environ.get("UNBROKEN_PUBLIC_URL", "http://127.0.0.1:8000")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "controlplane.jobs",
    "controlplane.ingest",
    "controlplane.dashboard",
    "controlplane.launchers",
    "controlplane.api",
    "axes",
]

MIDDLEWARE = [
    "controlplane.healthz.HealthCheckMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "controlplane.security.ContentSecurityPolicyMiddleware",
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
WSGI_APPLICATION = "controlplane.wsgi.application"
ASGI_APPLICATION = "controlplane.asgi.application"

DATABASE_URL = os.environ.get("DATABASE_URL", "")
if DATABASE_URL:
    # 0 by default: under Django's ASGI handler each request runs in its own thread, so persistent
    # connections would pile up. The ingest fast path keeps its own single connection anyway.
    DATABASES = {"default": dj_database_url.parse(
        DATABASE_URL, conn_max_age=int(env_float("UNBROKEN_DB_CONN_MAX_AGE", 0)), conn_health_checks=True)}
else:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "unbroken.sqlite3",
            # WAL lets the dashboard read while ingest writes; IMMEDIATE avoids upgrade deadlocks.
            "OPTIONS": {
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file, not shared-cache memory: end-to-end tests write from the live server, the
            # Celery worker and the test at once, which shared-cache SQLite answers with "table is locked".
            "TEST": {"NAME": str(DATA_DIR / f"test-unbroken-{os.getpid()}.sqlite3")},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "")

# Celery: Redis when configured, else kombu's filesystem transport (no server).
CELERY_BROKER_DIR = DATA_DIR / "broker"
if REDIS_URL:
    CELERY_BROKER_URL = REDIS_URL
else:
    for sub in ("in", "processed", "control"):
        (CELERY_BROKER_DIR / sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_URL = "filesystem://"
    # kombu's filesystem transport with its files written whole (a reader saw half-written ones and the
    # worker died): controlplane/filesystem_broker.py.
    CELERY_BROKER_TRANSPORT = "controlplane.filesystem_broker:Transport"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(CELERY_BROKER_DIR / "in"),
        "data_folder_out": str(CELERY_BROKER_DIR / "in"),
        "data_folder_processed": str(CELERY_BROKER_DIR / "processed"),
        "store_processed": False,
        "control_folder": str(CELERY_BROKER_DIR / "control"),
        # How long the worker waits between looks at an empty folder (kombu's default: 1 s, a watchdog
        # pass up to 1 s late). A look is one listdir of a small folder.
        "polling_interval": 0.1,
    }
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = True
# Redis: one message per pool process. The filesystem transport needs room: a worker without an event
# loop for it (Celery's ``synloop``) performs acks only between its 2 s waits for a message, so once it
# holds as many unacked messages as its prefetch allows it takes nothing more for 2 s. With 1 (2 messages
# for 2 processes) it took 2 messages per 2 s while beat puts ~3 a second (the watchdog every 0.5 s): the
# folder grew without end and the watchdog ran late, "did not run for 6 s" every ~24 s, idle or busy.
CELERY_WORKER_PREFETCH_MULTIPLIER = 1 if REDIS_URL else 16
CELERY_TASK_ALWAYS_EAGER = env_bool("UNBROKEN_CELERY_EAGER", False)
# Slow cluster calls get their own queue so a slow API server never delays fault detection.
CELERY_TASK_ROUTES = {
    "controlplane.launchers.tasks.*": {"queue": "launch"},
    "controlplane.jobs.tasks.*": {"queue": "default"},
}
CELERY_TASK_DEFAULT_QUEUE = "default"
WATCHDOG_INTERVAL_S = env_float("UNBROKEN_WATCHDOG_INTERVAL_S", 0.5)
# With Redis, rank rows in the database trail the heartbeat store by at most about this long.
HEARTBEAT_FLUSH_INTERVAL_S = env_float("UNBROKEN_HEARTBEAT_FLUSH_INTERVAL_S", 5.0)
CELERY_BEAT_SCHEDULE = {
    "watchdog": {"task": "controlplane.jobs.tasks.watchdog", "schedule": WATCHDOG_INTERVAL_S},
    "flush-heartbeats": {"task": "controlplane.jobs.tasks.flush_heartbeats",
                         "schedule": HEARTBEAT_FLUSH_INTERVAL_S},
    "send-notifications": {"task": "controlplane.jobs.tasks.send_notifications", "schedule": 5.0},
    "supervise-launchers": {"task": "controlplane.launchers.tasks.supervise", "schedule": 2.0},
}

# Ingest
INGEST_MAX_BODY_BYTES = int(env_float("UNBROKEN_INGEST_MAX_BODY_BYTES", 4 * 1024 * 1024))
# Heartbeat and event timestamps older than this (against the server clock) are refused with 422.
# Generous on purpose: a reporter replays its disk spool after an outage, and drops a refused batch.
INGEST_MAX_AGE_S = env_float("UNBROKEN_INGEST_MAX_AGE_S", 7 * 24 * 3600.0)
# Batches one web process queues for its ingest thread before it sheds new ones (429 + Retry-After; 0: never).
INGEST_MAX_PENDING = int(env_float("UNBROKEN_INGEST_MAX_PENDING", 64))
if INGEST_MAX_PENDING < 0:
    raise ImproperlyConfigured(f"UNBROKEN_INGEST_MAX_PENDING={INGEST_MAX_PENDING}: must be 0 (never shed) or more")

# Notifications
EMAIL_BACKEND = os.environ.get("UNBROKEN_EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
EMAIL_HOST = os.environ.get("UNBROKEN_EMAIL_HOST", "localhost")
EMAIL_PORT = int(env_float("UNBROKEN_EMAIL_PORT", 25))
EMAIL_HOST_USER = os.environ.get("UNBROKEN_EMAIL_USER", "")
EMAIL_HOST_PASSWORD = env_secret("UNBROKEN_EMAIL_PASSWORD")
DEFAULT_FROM_EMAIL = os.environ.get("UNBROKEN_EMAIL_FROM", "unbroken@localhost")

# Kubernetes launcher (on when a kubeconfig or in-cluster config exists)
KUBECONFIG = os.environ.get("KUBECONFIG", "")
UNBROKEN_K8S_INGEST_URL = os.environ.get("UNBROKEN_K8S_INGEST_URL", PUBLIC_URL)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Login throttling (django-axes; controlplane/jobs/logins.py): 10 wrong passwords lock the account, and the
# address, for 15 minutes; counted by the connection's address, never X-Forwarded-For.
AUTHENTICATION_BACKENDS = ["controlplane.jobs.logins.LoginThrottle",
                           "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = int(env_float("UNBROKEN_LOGIN_FAILURE_LIMIT", 10))
AXES_COOLOFF_TIME = timedelta(minutes=env_float("UNBROKEN_LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_CLIENT_IP_CALLABLE = "controlplane.jobs.logins.client_address"
AXES_LOCKOUT_CALLABLE = "controlplane.jobs.logins.locked_out"
AXES_RESET_ON_SUCCESS = True
AXES_VERBOSE = False
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:jobs"
LOGOUT_REDIRECT_URL = "login"
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
SESSION_COOKIE_SECURE = env_bool("UNBROKEN_SECURE_COOKIES", False)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)
# Serve straight from static/ and installed packages too, so a missed collectstatic never breaks a page.
WHITENOISE_USE_FINDERS = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("UNBROKEN_LOG_LEVEL", "INFO")},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
