"""What a fault's text may carry off the rank: the one redaction of the product (``redact``), used by the
trainer before a fault leaves the rank and by the control plane before a fault or a log is stored or shown,
and the cap on a fault's stored text. Standard library only (``trainer.wire`` re-exports it).
"""

from __future__ import annotations

import re

MAX_EVIDENCE_CHARS = 4000  # a fault's message with its traceback, as stored
# A name that holds a secret: its last part is one of these words (``HF_TOKEN``, ``db_password``,
# ``OPENAI_API_KEY``, ``DB_PASS``), so ``tokens=``, ``max_tokens=``, ``token_count=`` and ``tokenizer=`` are
# code and numbers, not secrets.
SECRET_NAME = (r"(?<![A-Za-z0-9_.-])(?:[A-Za-z0-9]+[_.-])*"
               r"(?:[A-Za-z0-9]*(?:TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?|APIKEY)|PASS|PWD"
               r"|(?:API|PRIVATE|ACCESS|SECRET|AUTH)[_.-]?KEY)(?![A-Za-z0-9])")
# Well-known token shapes, whatever name carries them: ours (ingest tokens, ``ubk_``), Hugging Face,
# GitHub, AWS access key ids, OpenAI/Anthropic-style keys, Slack, JWTs.
TOKEN_SHAPES = (r"ubk_[A-Za-z0-9_-]{20,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|"
                r"github_pat_[A-Za-z0-9_]{20,}|"
                r"A[KS]IA[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|"
                r"eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")
REDACTED = "[redacted]"
_REDACT = re.compile(
    # name, its closing quote in a dict's repr ('HF_TOKEN': '...'), separator, the value; a value already
    # redacted is left alone (the text passes through here on the rank and again on the control plane).
    rf"(?i:(?P<name>{SECRET_NAME})(?P<sep>['\"]?\s*[=:]\s*)(?P<q>['\"]?)"
    r"(?!\[redacted\])(?P<value>[^\s'\",;()\[\]{}]+))"
    r"|(?i:(?P<scheme>bearer|basic)\s+)(?!\[redacted\])(?P<cred>[A-Za-z0-9._~+/=-]{8,})"
    rf"|(?P<shape>\b(?:{TOKEN_SHAPES})\b)"
    r"|(?P<url>(?<=://)[^\s/:@]+:[^\s/@]+(?=@))")
_SECRET_VALUE = re.compile(rf"\b(?:{TOKEN_SHAPES})\b")


def looks_secret(value: str) -> bool:
    """Whether ``value`` has a well-known token's shape (the spec's env check refuses such values)."""
    return bool(_SECRET_VALUE.search(value))


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """``text`` without secrets: the given values (the job's ingest token), values of names that look
    like secrets (``HF_TOKEN=...``, ``password: ...``, ``'DB_PASS': '...'``), ``Bearer``/``Basic``
    credentials, well-known token shapes (our ingest tokens, Hugging Face, GitHub, AWS access key ids,
    OpenAI-style keys, Slack, JWTs) and passwords in URLs. The one redaction of the product: used by the
    trainer before a fault leaves the rank, by the control plane before a fault or a log is stored or
    shown. Idempotent: redacting twice changes nothing more."""
    for s in secrets:
        if s and len(s) >= 6:
            text = text.replace(s, REDACTED)

    def sub(m: re.Match) -> str:
        if m.group("name"):
            return f"{m.group('name')}{m.group('sep')}{m.group('q')}{REDACTED}"
        if m.group("cred"):
            return f"{m.group('scheme')} {REDACTED}"
        if m.group("url"):
            return f"{m.group('url').split(':', 1)[0]}:{REDACTED}"
        return REDACTED

    return _REDACT.sub(sub, text)
