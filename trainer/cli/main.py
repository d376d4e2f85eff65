"""The ``unbroken`` command: see ``unbroken --help`` and docs/reference/cli.md."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from trainer.cli import credentials
from trainer.cli.client import EXIT_INPUT, EXIT_JOB_FAILED, EXIT_SERVER, ApiError, Client
from trainer.cli.follow import FINAL, Bar, Follower
from trainer.wire import DrillFault, Layer

POLL_S = 1.0
OUTAGE_S = 300.0  # how long a follow waits out an unreachable server before it gives up (exit 4)
# Spec fields the run command sets from a flag: a refusal of the field names the flag too.
FLAG_OF = {"procs_per_node": "--nproc-per-node", "nodes": "--nodes", "steps": "--steps",
           "backend": "--backend", "in_process": "--level", "entrypoint": "SCRIPT", "args": "ARGS",
           "env": "--env", "working_dir": "--workdir", "kubernetes.image": "--image", "kubernetes": "--image"}

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def _client() -> Client:
    return Client(credentials.load())


def _json(obj) -> None:
    click.echo(json.dumps(obj, indent=2))


class JobId(click.ParamType):
    name = "JOB"

    def convert(self, value, param, ctx):
        text = str(value).lstrip("#")
        if not text.isdigit():
            self.fail(f"{value!r}: give the job's number (see `unbroken ls`)", param, ctx)
        return int(text)

    def shell_complete(self, ctx, param, incomplete):
        try:
            jobs = _client().get("/jobs", limit=50)["jobs"]
        except (click.ClickException, OSError):
            return []
        return [click.shell_completion.CompletionItem(str(j["id"]), help=f"{j['name']} ({j['status']})")
                for j in jobs if str(j["id"]).startswith(incomplete)]


JOB = JobId()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="unbroken-sdk", prog_name="unbroken")
def cli() -> None:
    """Run your training script under Unbroken and watch it recover, from your terminal.

    Credentials: `unbroken login URL`, or UNBROKEN_URL and UNBROKEN_API_TOKEN.
    Shell completion (bash; zsh and fish likewise): eval "$(_UNBROKEN_COMPLETE=bash_source unbroken)"
    """


@cli.command()
@click.argument("url")
@click.option("--token-stdin", is_flag=True,
              help="read the token from standard input (scripts) instead of a prompt")
def login(url: str, token_stdin: bool) -> None:
    """Store URL and an API token (from your user menu's "API tokens" page) for later commands."""
    url = credentials.normalise_url(url)
    if token_stdin:
        token = sys.stdin.readline().strip()
    else:
        token = click.prompt(f"API token for {url} (from its API tokens page; input hidden)",
                             hide_input=True).strip()
    if not token:
        raise click.UsageError("no token given")
    creds = credentials.Credentials(url=url, token=token)
    client = Client(creds)
    try:
        client.get("/jobs", limit=1)
    finally:
        client.close()
    path = credentials.store(creds)
    console.print(f"Logged in to {escape(url)}; the token is stored in {escape(str(path))} (mode 0600).")


def _drill(text: str) -> dict:
    parts = text.split(":")
    try:
        if len(parts) == 3:
            return {"step": int(parts[0]), "fault": parts[1], "rank": int(parts[2])}
        if len(parts) == 4 and parts[1] == DrillFault.SLOW_RANK:
            return {"step": int(parts[0]), "fault": parts[1], "rank": int(parts[2]),
                    "fraction": float(parts[3])}
    except ValueError:
        pass
    raise click.BadParameter(f"{text!r}: write STEP:FAULT:RANK, e.g. 100:sigkill:1", param_hint="--drill")


def _level(level: str, script: Path | None) -> bool | None:
    """``in_process`` for the spec: only an SDK entrypoint function (Level 2) can be restarted in-process."""
    if level == "auto":
        if script is None or not script.is_file():
            return None
        return bool(re.search(r"@\s*unbroken\.entrypoint\b", script.read_text(errors="replace")))
    return level == "2"


def build_spec(*, script: str, args: tuple[str, ...], nproc_per_node: int | None, nodes: int | None,
               level: str, drills: tuple[str, ...], backend: str, image: str | None, namespace: str | None,
               steps: int | None, env: tuple[str, ...], workdir: str | None, sets: tuple[str, ...]) -> dict:
    """The job spec the web form's "Your own script" builds, from the command line's flags."""
    spec: dict = {"backend": backend, "args": list(args)}
    local_path = None
    if backend == "local":
        path = Path(script).expanduser()
        if not path.exists():
            raise click.BadParameter(f"{script}: no such file here (the local backend runs it on the "
                                     "server's machine from this path)", param_hint="SCRIPT")
        local_path = path.resolve()
        spec["entrypoint"] = str(local_path)
        spec["working_dir"] = str(Path(workdir).resolve() if workdir else Path.cwd())
    else:
        spec["entrypoint"] = script  # a path inside the image (or a module), resolved in the container
        local_path = Path(script) if Path(script).is_file() else None
        if workdir:
            spec["working_dir"] = workdir
        k8s: dict = {}
        if image:
            k8s["image"] = image
        if namespace:
            k8s["namespace"] = namespace
        spec["kubernetes"] = k8s
    for key, value in (("procs_per_node", nproc_per_node), ("nodes", nodes), ("steps", steps)):
        if value is not None:
            spec[key] = value
    in_process = _level(level, local_path)
    if in_process is not None:
        spec["in_process"] = in_process
    if drills:
        spec["drills"] = [_drill(d) for d in drills]
    if env:
        pairs = {}
        for item in env:
            name, eq, value = item.partition("=")
            if not eq or not name:
                raise click.BadParameter(f"{item!r}: write NAME=value", param_hint="--env")
            pairs[name] = value
        spec["env"] = pairs
    for item in sets:
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise click.BadParameter(f"{item!r}: write FIELD=VALUE (VALUE as JSON, or a string)",
                                     param_hint="--set")
        try:
            spec[name] = json.loads(value)
        except ValueError:
            spec[name] = value
    return spec


def _refused_spec(e: ApiError) -> click.ClickException:
    """A 422 with the fields the API named, one per line, with the flag that sets each."""
    fields = e.body.get("fields") or ({e.body["field"]: e.message} if e.body.get("field") else {})
    lines = ["the server refused the job:"]
    for name, why in fields.items():
        flag = FLAG_OF.get(name) or FLAG_OF.get(name.split("[")[0])
        if flag is None:
            flag = "--drill" if name.startswith("drills") else f"--set {name}=..."
        lines.append(f"  {name} ({flag}): {why}")
    for problem in e.body.get("preflight") or ():
        lines.append(f"  {problem}")
    if len(lines) == 1:
        lines.append(f"  {e.message}")
    out = click.ClickException("\n".join(lines))
    out.exit_code = EXIT_INPUT
    return out


@cli.command(context_settings={"allow_interspersed_args": False})
@click.argument("script")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--nproc-per-node", type=click.IntRange(min=0),
              help="ranks per node (torchrun's flag; default 2)")
@click.option("--nodes", type=click.IntRange(min=0), help="nodes (local backend: 1)")
@click.option("--level", type=click.Choice(["auto", "0", "1", "2"]), default="auto", show_default=True,
              help="the script's SDK level; 2 (an @unbroken.entrypoint function) turns in-process restarts "
                   "on; auto reads the script")
@click.option("--drill", "drills", multiple=True, metavar="STEP:FAULT:RANK",
              help="a fault drill, e.g. 100:sigkill:1 (repeatable)")
@click.option("--backend", type=click.Choice(["local", "kubernetes"]), default="local", show_default=True)
@click.option("--image", help="kubernetes: the image your script and the SDK are in")
@click.option("--namespace", help="kubernetes: the namespace")
@click.option("--steps", type=click.IntRange(min=0), help="how far the script goes (the progress bar; drills "
                                                          "fall before it; default 300)")
@click.option("--env", multiple=True, metavar="NAME=VALUE",
              help="an environment variable of the ranks (no secrets)")
@click.option("--workdir", help="the working directory (local default: this one)")
@click.option("--set", "sets", multiple=True, metavar="FIELD=VALUE", help="any other job spec field, e.g. "
              "step_timeout_s=60 (VALUE as JSON)")
@click.option("--name", help="the job's name (default: the script's)")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="follow the job to its end and exit with its outcome; --no-wait prints its URL and "
                   "returns")
@click.option("--log/--no-log", "show_log", default=True, show_default=True, help="stream the job's log tail")
@click.option("--json", "as_json", is_flag=True, help="print the created job as JSON (implies --no-wait)")
def run(script, args, nproc_per_node, nodes, level, drills, backend, image, namespace, steps, env, workdir,
        sets, name, wait, show_log, as_json) -> None:
    """Run SCRIPT (with ARGS after --) as a job and follow it.

    \b
    unbroken run --nproc-per-node 2 --drill 100:sigkill:1 train.py -- --steps 300
    Exit status with --wait: 0 the job succeeded; 1 it failed or was stopped; 2 bad input or a refused
    spec; 3 credentials; 4 the server unreachable.
    """
    if args and args[0] == "--":
        args = args[1:]
    spec = build_spec(script=script, args=tuple(args), nproc_per_node=nproc_per_node, nodes=nodes,
                      level=level, drills=drills, backend=backend, image=image, namespace=namespace,
                      steps=steps, env=env, workdir=workdir, sets=sets)
    client = _client()
    try:
        job = client.post("/jobs", {"name": (name or Path(script).stem)[:100], "spec": spec})
    except ApiError as e:
        if e.status == 422:
            raise _refused_spec(e) from None
        raise
    if as_json:
        _json(job)
        return
    console.print(f"Job {job['id']}: {client.page_url(job)}")
    if wait:
        sys.exit(_follow(client, job["id"], show_log=show_log))


def _follow(client: Client, job_id: int, *, show_log: bool) -> int:
    """Follow the job to its end (Ctrl-C: stop, detach or keep watching); the exit status of its outcome."""
    follower = Follower(client, job_id, console, show_log=show_log)
    while True:
        try:
            with Bar(console) as bar:
                while True:
                    job = _poll(follower)
                    if job is not None:
                        bar.update(step=job["last_step"], steps=job["steps"], loss=follower.loss,
                                   rate=follower.steps_per_s())
                        if job["status"] in FINAL:
                            bar.stop()
                            return _outcome(job)
                    time.sleep(POLL_S)
        except KeyboardInterrupt:
            if not sys.stdin.isatty():
                console.print(f"detached: job {job_id} keeps running (unbroken status {job_id})")
                return 130
            choice = click.prompt("\nStop the job, detach (it keeps running) or keep watching?",
                                  type=click.Choice(["stop", "detach", "watch"]), default="detach")
            if choice == "detach":
                console.print(f"detached: job {job_id} keeps running; `unbroken logs -f {job_id}` follows it "
                              "again")
                return 0
            if choice == "stop":
                cmd = client.post(f"/jobs/{job_id}/commands", {"kind": "stop"})
                console.print(f"stop requested (command {cmd['id']}, {cmd['status']})")


def _poll(follower: Follower) -> dict | None:
    """One poll; while the server is away (a restart, a network blip) None, for up to OUTAGE_S."""
    try:
        job = follower.poll()
    except ApiError as e:
        if e.exit_code != EXIT_SERVER:
            raise
        now = time.monotonic()
        if follower.away_since is None:
            follower.away_since = now
            err.print(f"[yellow]{escape(e.message)}; still trying for {OUTAGE_S:.0f} s[/]")
        elif now - follower.away_since > OUTAGE_S:
            raise
        return None
    if follower.away_since is not None:
        follower.away_since = None
        console.print("the server answers again")
    return job


def _outcome(job: dict) -> int:
    if job["status"] == "succeeded":
        console.print(f"[bold green]job {job['id']} succeeded[/] at step {job['last_step']}")
        return 0
    reason = job.get("status_reason") or "no reason recorded"  # all of it: CI logs keep the traceback
    err.print(f"[bold red]job {job['id']} {job['status']}[/]: {escape(reason)}")
    return EXIT_JOB_FAILED


@cli.command("ls")
@click.option("--status", type=click.Choice(list(FINAL) + ["pending", "launching", "running", "recovering"]))
@click.option("--limit", type=click.IntRange(1, 500), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="the API's JobList")
def list_jobs(status, limit, as_json) -> None:
    """Jobs, newest first."""
    page = _client().get("/jobs", status=status, limit=limit)
    if as_json:
        _json(page)
        return
    table = Table("ID", "NAME", "STATUS", "STEP", "BACKEND", "CREATED", box=None)
    for j in page["jobs"]:
        table.add_row(str(j["id"]), escape(j["name"]), j["status"], f"{j['last_step']}/{j['steps']}",
                      j["backend"], j["created_at"][:19].replace("T", " "))
    console.print(table)


@cli.command()
@click.argument("job_id", metavar="JOB", type=JOB)
@click.option("--json", "as_json", is_flag=True, help="the API's JobDetail")
def status(job_id: int, as_json: bool) -> None:
    """The job's summary: goodput, restarts per layer, faults with their one-sentence summaries."""
    client = _client()
    job = client.get(f"/jobs/{job_id}")
    if as_json:
        _json(job)
        return
    s = job["summary"]
    console.print(f"[bold]job {job['id']}[/] {escape(job['name'])}: [bold]{job['status']}[/]"
                  + (f" ({escape(job['status_reason'])})" if job["status_reason"] else ""))
    console.print(f"  {client.page_url(job)}")
    console.print(f"  step {job['last_step']}/{job['steps']} · attempt {job['attempt']} · {job['backend']}")
    console.print(f"  goodput {s['goodput']['goodput'] * 100:.1f} % of {s['goodput']['wall_s']:.0f} s")
    restarts = ", ".join(f"{k} {v}" for k, v in s["restarts"].items() if v) or "none"
    console.print(f"  restarts: {restarts} · faults: {s['faults']}")
    page = client.get(f"/jobs/{job_id}/faults", limit=20)
    for f in page["faults"]:
        summary = client.get(f"/jobs/{job_id}/faults/{f['id']}")["evidence"]["summary"]
        console.print(f"  ✗ fault {f['id']} ({f['fault_class']}): {escape(summary)}")
    if page["next"]:
        console.print(f"  … more faults on the job's page, or `unbroken status {job_id} --json` and the API")


@cli.command()
@click.argument("job_id", metavar="JOB", type=JOB)
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines until the job ends")
@click.option("--json", "as_json", is_flag=True, help="the API's Log (not with -f)")
def logs(job_id: int, follow: bool, as_json: bool) -> None:
    """The end of the job's log (about the last 12 KB); -f follows it until the job ends."""
    client = _client()
    if as_json:
        _json(client.get(f"/jobs/{job_id}/log"))
        return
    follower = Follower(client, job_id, Console(highlight=False, no_color=not sys.stdout.isatty()))
    log = client.get(f"/jobs/{job_id}/log")
    if not follow:
        if log["text"] is None:
            raise ApiError(f"no log: {log['why']}", exit_code=EXIT_INPUT)
        click.echo(log["text"], nl=not log["text"].endswith("\n"))
        return
    try:
        while True:
            job = client.get(f"/jobs/{job_id}")
            follower.print_log(client.get(f"/jobs/{job_id}/log"))
            if job["status"] in FINAL:
                sys.exit(0 if job["status"] == "succeeded" else EXIT_JOB_FAILED)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        sys.exit(130)


def _command(job_id: int, body: dict, as_json: bool) -> None:
    cmd = _client().post(f"/jobs/{job_id}/commands", body)
    if as_json:
        _json(cmd)
        return
    what = body["kind"]
    if body.get("level"):
        what += f" at {body['level']}"
    if body.get("fault"):
        what += f" {body['fault']}"
    if "rank" in body:
        what += f" on rank {body['rank']}"
    console.print(f"command {cmd['id']} ({escape(what)}): {cmd['status']}"
                  + (f", {escape(cmd['detail'])}" if cmd.get("detail") else ""))


@cli.command()
@click.argument("job_id", metavar="JOB", type=JOB)
@click.option("--level", required=True,
              type=click.Choice([Layer.IN_PROCESS.value, Layer.IN_JOB.value, Layer.JOB.value]),
              help="in_process (Level 2 scripts), in_job (new ranks) or job (a new attempt)")
@click.option("--rank", type=click.IntRange(min=0), help="restart one rank (in_process only)")
@click.option("--json", "as_json", is_flag=True)
def restart(job_id: int, level: str, rank: int | None, as_json: bool) -> None:
    """Restart the job at a layer (operators)."""
    body = {"kind": "restart", "level": level}
    if rank is not None:
        body["rank"] = rank
    _command(job_id, body, as_json)


@cli.command()
@click.argument("job_id", metavar="JOB", type=JOB)
@click.argument("fault", type=click.Choice([f.value for f in DrillFault]))
@click.option("--rank", required=True, type=click.IntRange(min=0), help="the rank to inject into")
@click.option("--json", "as_json", is_flag=True)
def inject(job_id: int, fault: str, rank: int, as_json: bool) -> None:
    """Inject a fault drill into one rank (operators)."""
    _command(job_id, {"kind": "inject_fault", "fault": fault, "rank": rank}, as_json)


@cli.command()
@click.argument("job_id", metavar="JOB", type=JOB)
@click.option("--json", "as_json", is_flag=True)
def stop(job_id: int, as_json: bool) -> None:
    """Stop the job (operators)."""
    _command(job_id, {"kind": "stop"}, as_json)


def _s(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f} s"


@cli.command()
@click.argument("job_id", metavar="JOB", type=JOB)
@click.option("--gpus", type=click.IntRange(1, 10**7), help="project goodput at this many GPUs")
@click.option("--json", "as_json", is_flag=True, help="the API's Report")
@click.option("--html", "html", type=click.Path(dir_okay=False, writable=True), metavar="FILE",
              help="write the report as one self-contained HTML file (plotly inlined, opens offline)")
def report(job_id: int, gpus: int | None, as_json: bool, html: str | None) -> None:
    """The job's resilience report: which failures it survived, how fast, what saves cost, goodput at scale.

    The page (its URL is printed) draws the same figures; --html FILE writes them as one self-contained
    HTML file to keep or share."""
    client = _client()
    if html:
        data = client.get_file(f"/jobs/{job_id}/report", format="html", **({"gpus": gpus} if gpus else {}))
        try:
            with open(html, "wb") as f:
                f.write(data)
        except OSError as e:
            raise click.ClickException(f"cannot write {html}: {e.strerror}") from None
        console.print(f"wrote {escape(html)} ({len(data) / 1e6:.1f} MB): open it in a browser, no network needed")
        return
    r = client.get(f"/jobs/{job_id}/report", **({"gpus": gpus} if gpus else {}))
    if as_json:
        _json(r)
        return
    console.print(f"[bold]job {r['job']}[/] {escape(r['name'])}: {r['status']} · level {r['level']}")
    console.print(f"  {client.base}/jobs/{r['job']}/report/")
    for c in r["classes"]:
        layers = ", ".join(f"{k} {v}" for k, v in c["layers"].items()) or "–"
        console.print(f"  {c['fault_class']:<16} faults {c['faults']} · recovered {c['recovered']}"
                      f"/{len(c['cycles'])} by {layers} · recovery p50 {_s(c['recovery']['p50_s'])}"
                      f" p95 {_s(c['recovery']['p95_s'])} (n={c['recovery']['n']})")
    if r["missing"]:
        console.print(f"  not yet drilled: {', '.join(r['missing'])} (a resilience check covers them)")
    rec = r["recovery"]
    share = rec["reload_share"]
    console.print(f"  detection p50 {_s(rec['detection']['p50_s'])} · recovery p50 {_s(rec['recovery']['p50_s'])}"
                  f" p95 {_s(rec['recovery']['p95_s'])}"
                  + (f" · reload {share * 100:.0f} % of it" if share is not None else ""))
    saves = r["saves"]
    console.print(f"  saves: cost p50 async {_s(saves['async_cost']['p50_s'])} (n={saves['async_cost']['n']}),"
                  f" sync {_s(saves['sync_cost']['p50_s'])} (n={saves['sync_cost']['n']})")
    scale = r["at_scale"]
    if scale:
        console.print(f"  at {scale['gpus']:,} GPUs ({scale['rate_source']}):")
        for sc in scale["scenarios"]:
            best = sc["best_interval_steps"]
            console.print(f"    {sc['name']}: goodput {sc['goodput_now'] * 100:.1f} %"
                          + (f", {sc['goodput_best'] * 100:.1f} % saving every {best} steps" if best else ""))


if __name__ == "__main__":
    cli(prog_name="unbroken")
