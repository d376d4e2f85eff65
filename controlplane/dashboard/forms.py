"""The new-job form: one field per JobSpec field; JobSpec itself validates (SpecError.errors names fields).

Drills are one per line as ``step:fault:rank`` (``Drill.as_flag``); Kubernetes settings live in
their own fieldset, used (and validated) only when that backend is chosen.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from django import forms
from django.conf import settings

from controlplane.jobs.spec import (
    BACKENDS,
    CHECKPOINT_MODES,
    DEMO_SPEC,
    PRESETS,
    Drill,
    JobSpec,
    KubernetesSpec,
    SpecError,
)
from trainer.policy_rules import RULE_ACTIONS
from trainer.wire import DrillFault

K8S_PREFIX = "k8s_"

# The example of an unmodified FSDP2 script that ships with the SDK (trainer/examples/plain_fsdp.py).
EXAMPLE_SCRIPT = str(Path(settings.BASE_DIR) / "trainer" / "examples" / "plain_fsdp.py")

# Presets shown as buttons above the form: name -> (label, description, spec overrides).
PRESET_CHOICES = {
    "demo": (
        "Demo",
        "2 ranks on this machine's CPU for about 5 minutes (1,500 steps), with two fault drills (an "
        "exception at step 300 on rank 1, a SIGKILL at step 900 on rank 0): time to try a restart and an "
        "injection of your own while it runs",
        DEMO_SPEC,
    ),
    "own-script": (
        "Your own script",
        "an unmodified FSDP2 script run under ft_launcher (here the example trainer/examples/plain_fsdp.py; "
        "put your script's path instead), a SIGKILL drill at step 100 on rank 1",
        JobSpec(entrypoint=EXAMPLE_SCRIPT, args=("--steps", "300"), steps=300, in_process=False,
                drills=(Drill(step=100, fault="sigkill", rank=1),)),
    ),
    "cpu-small": (
        "Small, no drills",
        "2 ranks on CPU, the small model, 600 steps",
        JobSpec(preset="small", steps=600),
    ),
    "k8s-1b": (
        "Kubernetes 1B",
        "2 nodes × 8 GPUs on Kubernetes, sync-free async checkpoints",
        JobSpec(
            backend="kubernetes",
            nodes=2,
            procs_per_node=8,
            preset="1b",
            steps=5000,
            checkpoint_interval=100,
            kubernetes=KubernetesSpec(),
        ),
    ),
}


class JobForm(forms.Form):
    name = forms.CharField(max_length=100, initial="demo")
    backend = forms.ChoiceField(choices=[(b, b) for b in BACKENDS])
    nodes = forms.IntegerField(min_value=1)
    procs_per_node = forms.IntegerField(min_value=1, label="Processes per node")
    preset = forms.ChoiceField(choices=[(p, p) for p in PRESETS], label="Model preset",
                               help_text="the built-in example model; not used when you run your own script")
    entrypoint = forms.CharField(
        required=False, max_length=1024, label="Your script",
        help_text="train.py (a path in the working directory, or absolute), pkg.train (run like python -m) or "
                  "pkg.train:main; empty = the built-in example model")
    args = forms.CharField(required=False, max_length=16384, label="Script arguments",
                           help_text="as on a command line, e.g. --steps 300 --lr 3e-4")
    working_dir = forms.CharField(required=False, max_length=1024, label="Working directory",
                                  help_text="absolute path; local jobs default to the control plane's directory")
    env = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}), label="Environment",
                          help_text="one NAME=value per line; no secrets (they are stored and shown in plain text)")
    steps = forms.IntegerField(min_value=1)
    checkpoint_interval = forms.IntegerField(min_value=1, help_text="steps between checkpoints")
    checkpoint_mode = forms.ChoiceField(choices=[(m, m) for m in CHECKPOINT_MODES])
    keep_checkpoints = forms.IntegerField(min_value=1)
    local_checkpoint_copy = forms.BooleanField(
        required=False, label="Node-local copy of the newest async save",
        help_text="in-job restarts load it from the node's shared memory instead of the durable checkpoint")
    in_process = forms.BooleanField(required=False, label="In-process restarts (NVRx Wrapper)")
    node_agent = forms.BooleanField(required=False, label="Node agent (one request per node per interval)",
                                    help_text="recommended past one node (the API turns it on there when unset)")
    in_job = forms.BooleanField(required=False, label="In-job restarts (ft_launcher)")
    fork_ranks = forms.BooleanField(
        required=False, label="Warm ranks (fork each rank from a fork server)",
        help_text="in-job restarts ~2 s faster; steady steps measured ~8 % slower on a CPU host")
    job_restart = forms.BooleanField(required=False, label="Job-level restarts (new processes / pods)")
    max_in_process_restarts = forms.IntegerField(min_value=0)
    max_in_job_restarts = forms.IntegerField(min_value=0)
    max_job_restarts = forms.IntegerField(min_value=0)
    max_no_progress_restarts = forms.IntegerField(
        min_value=0, required=False, label="Stop after restarts without progress",
        help_text="NVRx 0.6+: ft_launcher gives up after this many in-job restarts in a row with no newer "
                  "checkpoint; 0 = off")
    heartbeat_interval_s = forms.FloatField(label="Heartbeat interval (s)")
    step_timeout_s = forms.FloatField(label="Step timeout (s)")
    checkpoint_timeout_s = forms.FloatField(label="Checkpoint timeout (s)")
    stall_timeout_s = forms.FloatField(
        label="Stall timeout (s)", help_text="heartbeats arrive but the step does not move"
    )
    storm_restarts = forms.IntegerField(
        min_value=1, help_text="restarts without step progress before the job is stopped"
    )
    straggler_margin_pct = forms.FloatField(
        required=False, label="Straggler margin (%)",
        help_text="a rank whose own work per step is this much above the others' median is a straggler; 0 = off")
    straggler_window_s = forms.FloatField(
        required=False, label="Straggler window (s)", help_text="each rank's work per step is averaged over this")
    drills = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text="one per line: step:fault:rank, fault one of " + ", ".join(f.value for f in DrillFault)
                  + " (slow_rank takes a fourth part, the fraction slower: 60:slow_rank:1:0.3)",
    )
    failure_policy = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        label="Failure policy",
        help_text='JSON list of rules, first match decides; empty = each layer\'s default. E.g. '
                  '[{"match": {"class": "nan_loss"}, "action": "stop", "after": 2}, '
                  '{"match": {"exit_code": 93}, "action": "stop"}]. Actions: '
                  + ", ".join(a.value for a in RULE_ACTIONS),
    )
    notify_webhook_url = forms.URLField(
        required=False, assume_scheme="https", label="Webhook URL (notifications)"
    )
    notify_email = forms.EmailField(required=False, label="Email (notifications)")
    # Kubernetes
    k8s_namespace = forms.CharField(required=False, label="Namespace")
    k8s_image = forms.CharField(required=False, label="Image")
    k8s_gpus_per_node = forms.IntegerField(required=False, min_value=0, label="GPUs per node")
    k8s_efa_per_node = forms.IntegerField(required=False, min_value=0, label="EFA devices per node")
    k8s_checkpoint_claim = forms.CharField(required=False, label="Checkpoint PVC")
    k8s_node_selector = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Node selector",
        help_text="one key=value per line",
    )
    k8s_tolerations = forms.CharField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 2}),
        label="Tolerations",
        help_text='JSON list, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]',
    )
    k8s_nvrx_version = forms.CharField(
        required=False, max_length=32, label="NVRx version in the image",
        help_text="e.g. 0.4.1 or 0.6.0; the job's NVRx options are checked against it before launch")
    k8s_use_jobset = forms.BooleanField(required=False, label="Use JobSet (else an Indexed Job)")
    k8s_secrets = forms.CharField(
        required=False, widget=forms.Textarea(attrs={"rows": 2}), label="Secrets to mount",
        help_text="one Kubernetes Secret name per line, mounted read-only at /var/run/secrets/user/<name>/")
    k8s_command = forms.CharField(
        required=False, label="Wrapper command",
        help_text='optional, as on a command line; it must exec its arguments, e.g. '
                  'bash -c \'source /opt/env.sh && exec "$@"\' --')

    # The form's plain fields (python, the local interpreter, is set through the API).
    SPEC_FIELDS = tuple(f for f in JobSpec.__struct_fields__
                        if f not in ("drills", "kubernetes", "args", "env", "python", "failure_policy"))
    K8S_FIELDS = KubernetesSpec.__struct_fields__

    @classmethod
    def initial_for(cls, spec: JobSpec, name: str) -> dict:
        data = {k: getattr(spec, k) for k in cls.SPEC_FIELDS}
        data["name"] = name
        data["drills"] = "\n".join(d.as_flag() for d in spec.drills)
        data["args"] = shlex.join(spec.args)
        data["env"] = "\n".join(f"{k}={v}" for k, v in spec.env.items())
        data["failure_policy"] = (json.dumps([r.to_dict() for r in spec.failure_policy])
                                  if spec.failure_policy else "")
        k8s = spec.kubernetes or KubernetesSpec()
        for k in cls.K8S_FIELDS:
            v = getattr(k8s, k)
            if k == "node_selector":
                v = "\n".join(f"{a}={b}" for a, b in v.items())
            elif k == "tolerations":
                v = json.dumps(v) if v else ""
            elif k == "command":
                v = shlex.join(v)
            elif k == "secrets":
                v = "\n".join(v)
            data[K8S_PREFIX + k] = v
        return data

    def clean(self):
        cleaned = super().clean()
        if self.errors:
            return cleaned
        try:
            self.spec = JobSpec.from_dict(self._spec_dict(cleaned))
        except SpecError as e:
            for key, msg in e.errors.items():
                field = self.field_for(key)
                self.add_error(field, f"{key}: {msg}" if key.startswith("failure_policy[") else msg)
        return cleaned

    def _spec_dict(self, c: dict) -> dict:
        data = {k: c[k] for k in self.SPEC_FIELDS if c[k] is not None}  # blank optional: the spec default
        drills = []
        for i, line in enumerate(x.strip() for x in (c.get("drills") or "").splitlines()):
            if not line:
                continue
            parts = line.split(":")
            slow = len(parts) == 4 and parts[1].strip() == DrillFault.SLOW_RANK
            if len(parts) != 3 and not slow:
                raise SpecError({f"drills[{i}]": f"line {i + 1}: write step:fault:rank, e.g. 60:exception:1 "
                                                 "(or step:slow_rank:rank:fraction)"})
            try:
                drills.append({"step": int(parts[0]), "fault": parts[1].strip(), "rank": int(parts[2]),
                               **({"fraction": float(parts[3])} if slow else {})})
            except ValueError:
                raise SpecError({f"drills[{i}]": f"line {i + 1}: step and rank must be integers, "
                                                 "a fraction a number"}) from None
        data["drills"] = drills
        data["entrypoint"] = (c.get("entrypoint") or "").strip()
        data["working_dir"] = (c.get("working_dir") or "").strip()
        data["args"] = _split("args", c.get("args") or "")
        env = {}
        for line in (c.get("env") or "").splitlines():
            if line.strip():
                if "=" not in line:
                    raise SpecError({"env": f"{line.strip()!r}: write NAME=value"})
                a, b = line.split("=", 1)
                env[a.strip()] = b
        data["env"] = env
        text = (c.get("failure_policy") or "").strip()
        try:
            data["failure_policy"] = json.loads(text) if text else []
        except json.JSONDecodeError as e:
            raise SpecError({"failure_policy": f"not valid JSON: {e.msg} (line {e.lineno})"}) from None
        if c["backend"] == "kubernetes":
            k8s = {}
            for k in self.K8S_FIELDS:
                v = c.get(K8S_PREFIX + k)
                if k == "node_selector":
                    pairs = {}
                    for line in (v or "").splitlines():
                        if line.strip():
                            if "=" not in line:
                                raise SpecError(
                                    {"kubernetes.node_selector": f"{line.strip()!r}: write key=value"}
                                )
                            a, b = line.split("=", 1)
                            pairs[a.strip()] = b.strip()
                    v = pairs
                elif k == "tolerations":
                    try:
                        v = json.loads(v) if v and v.strip() else []
                    except json.JSONDecodeError as e:
                        raise SpecError({"kubernetes.tolerations": f"not valid JSON: {e.msg}"}) from None
                    if not isinstance(v, list):
                        raise SpecError({"kubernetes.tolerations": "must be a JSON list of objects"})
                elif k == "command":
                    v = _split("kubernetes.command", v or "")
                elif k == "secrets":
                    v = [x.strip() for x in (v or "").splitlines() if x.strip()]
                elif v in (None, ""):
                    continue  # the KubernetesSpec default
                k8s[k] = v
            data["kubernetes"] = k8s
        return data

    # The form's optional sections, below the essentials and the Start button: (title, note, fields,
    # fields whose value opens the section, the backend it belongs to).
    SECTIONS = (
        ("Your own code", "empty: the built-in example model",
         ("entrypoint", "args", "working_dir", "env"), ("entrypoint",), None),
        ("Checkpoints", "the built-in model's; your own script keeps its own",
         ("checkpoint_interval", "checkpoint_mode", "keep_checkpoints", "local_checkpoint_copy"), (), None),
        ("Resilience layers", "",
         ("in_process", "max_in_process_restarts", "in_job", "max_in_job_restarts", "fork_ranks", "job_restart",
          "max_job_restarts", "max_no_progress_restarts"), (), None),
        ("Supervision", "",
         ("heartbeat_interval_s", "step_timeout_s", "checkpoint_timeout_s", "stall_timeout_s", "storm_restarts",
          "straggler_margin_pct", "straggler_window_s", "node_agent", "failure_policy"), (), None),
        ("Fault drills", "", ("drills",), ("drills",), None),
        ("Notifications", "", ("notify_webhook_url", "notify_email"), (), None),
        ("Kubernetes", "", tuple(K8S_PREFIX + k for k in K8S_FIELDS), (), "kubernetes"),
    )

    def sections(self) -> list[dict]:
        """The optional sections to draw: collapsed unless one of their fields has an error or a value that
        matters (your own entrypoint, drills); a backend's section hidden for another backend."""
        backend = self["backend"].value() or "local"
        out = []
        for title, note, names, opening, only_for in self.SECTIONS:
            bound = [self[n] for n in names if n in self.fields]
            show = only_for is None or only_for == backend
            is_open = show and (any(f.errors for f in bound) or any(self[n].value() for n in opening))
            out.append({"title": title, "note": note, "fields": bound, "open": is_open, "backend": only_for,
                        "hidden": not show})
        return out

    def field_for(self, key: str) -> str | None:
        """The form field of a spec key (kubernetes.image: k8s_image); None for the form as a whole."""
        if key.startswith("drills"):
            return "drills"
        if key.startswith("failure_policy"):
            return "failure_policy"
        if key.startswith("kubernetes."):
            name = K8S_PREFIX + key.split(".", 1)[1]
            return name if name in self.fields else None
        if key == "kubernetes":
            return None
        return key if key in self.fields else None


def _split(field: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:
        raise SpecError({field: f"cannot split it like a command line: {e}"}) from None
