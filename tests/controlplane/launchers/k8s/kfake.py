"""A loopback Kubernetes API server for launcher tests: kmock's emulator plus a fidelity layer.

Served over real HTTP on 127.0.0.1 (a daemon thread) and driven with the official client. On top of
``kmock.KubernetesEmulator`` (an in-memory object store with watch) it adds what the launcher relies on:

- 201 on create, uid / resourceVersion / creationTimestamp, generateName, PUT;
- labelSelector and (equality) fieldSelector on list and watch, watch ``timeoutSeconds``;
- **422 Invalid** for any object that fails the pinned Kubernetes schema (kubernetes-validate, strict,
  ``K8S_VERSION``) or, for JobSets, the in-repo JSON schema (``jobset.schema.json``) with the embedded
  Job template checked as a strict batch/v1 Job;
- the garbage collector's cascade: deleting an owner deletes its dependents (ownerReferences by uid);
  ``hold_deletions`` keeps deleted objects terminating (deletionTimestamp) until ``release_deletions()``,
  like foreground deletion waiting for pods;
- pod logs (``/log``) from ``logs[(namespace, pod)]``; injected failures (``fail_next``).

What it cannot show (see shared/research/kubernetes-testing.md): defaulting, semantic validation, real
controllers (tests create pods and move them through phases themselves), resourceVersion resume.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import json
import pathlib
import threading
import uuid
from typing import Any

import aiohttp.web
import jsonschema
import kmock
import kubernetes_validate
from kmock._internal import enums, rendering
from kmock._internal.k8s import KubernetesError

K8S_VERSION = "1.33"
JOBSET_SCHEMA = json.loads((pathlib.Path(__file__).parent / "jobset.schema.json").read_text())


class Invalid(KubernetesError):
    pass


class Injected(KubernetesError):
    pass


def validate_object(obj: dict[str, Any]) -> list[str]:
    """Schema errors of one object as the API server would report them (empty when valid)."""
    if obj.get("apiVersion") == "jobset.x-k8s.io/v1alpha2" and obj.get("kind") == "JobSet":
        v = jsonschema.Draft202012Validator(JOBSET_SCHEMA)
        errs = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(obj)]
        for i, rj in enumerate(obj.get("spec", {}).get("replicatedJobs", []) or []):
            tmpl = rj.get("template", {}) if isinstance(rj, dict) else {}
            job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": tmpl.get("metadata", {}),
                   "spec": tmpl.get("spec", {})}
            errs += [f"spec.replicatedJobs[{i}].template.{e}" for e in validate_object(job)]
        return errs
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.utils.SchemaNotFoundError:
        return [f"no schema for {obj.get('apiVersion')}/{obj.get('kind')} in Kubernetes {K8S_VERSION}"]
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"]
    return []


def _selector_ok(labels: dict | None, selector: str | None) -> bool:
    labels = labels or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field_ok(obj: dict, selector: str | None) -> bool:
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        neg = "!=" in term
        k, v = term.split("!=" if neg else "=", 1)
        cur: Any = obj
        for part in k.strip().split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if (str(cur) == v.strip()) == neg:
            return False
    return True


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: null removes a key, objects merge, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        else:
            target[k] = _merge(target.get(k), v)
    return target


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KFake(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        info = self.resources["jobset.x-k8s.io/v1alpha2/jobsets"]
        info.kind, info.namespaced = "JobSet", True
        info.verbs = {"create", "delete", "get", "list", "patch", "update", "watch"}
        self._rv = itertools.count(1000)
        self.hold_deletions = False
        self.held: list[tuple] = []
        self.logs: dict[tuple[str, str], str] = {}
        # kmock cannot parse /api/v1/namespaces (POST crashes), so namespaces live here; GET one works.
        self.namespaces: set[str] = set()
        self.jobset_installed = True
        self.access_allowed = True  # the answer to SelfSubjectAccessReviews
        self.failures: list[tuple[str, str, int]] = []  # (method, path substring, status)
        self.log_requests: list[tuple[str, str, dict, Any]] = []
        self.fallback["put"] << self._serve_replace
        self.fallback["get /apis/"] << self._serve_apis
        self.fallback["get /api/"] << self._serve_api

    def fail_next(self, method: str, path_part: str, status: int) -> None:
        """Answer the next ``method`` request whose path contains ``path_part`` with ``status``."""
        self.failures.append((method.upper(), path_part, status))

    def _fill_type(self, request) -> None:
        res = request.resource
        gv = f"{res.group}/{res.version}" if res.group else res.version
        request.data.setdefault("apiVersion", gv)
        if "kind" not in request.data:
            for r in self.resources:
                if (r.group, r.version, r.plural) == (res.group, res.version, res.plural) and self.resources[r].kind:
                    request.data["kind"] = self.resources[r].kind
                    break

    def _validate(self, obj: dict) -> None:
        errs = validate_object(obj)
        if errs:
            name = obj.get("metadata", {}).get("name")
            raise Invalid(status=422, reason="Invalid",
                          message=f'{obj.get("kind")}.{obj.get("apiVersion")} "{name}" is invalid: ' + "; ".join(errs),
                          details={"name": name, "kind": obj.get("kind"), "causes": [{"message": e} for e in errs]})

    async def _handle(self, request):
        self.log_requests.append((str(request.method).upper(), request.url.path, dict(request.params),
                                  json.loads(json.dumps(request.data)) if request.data is not None else None))
        for i, (method, part, status) in enumerate(self.failures):
            if str(request.method).upper().endswith(method) and part in request.url.path:
                del self.failures[i]
                raise Injected(status=status, reason="Injected", message=f"injected {status} by the test")
        parts = request.url.path.strip("/").split("/")
        if parts == ["version"]:
            return aiohttp.web.json_response({"major": "1", "minor": K8S_VERSION.split(".")[1],
                                              "gitVersion": f"v{K8S_VERSION}.0", "platform": "linux/amd64"})
        if str(request.method).upper().endswith("GET") and parts[:3] == ["api", "v1", "namespaces"] \
                and len(parts) == 4:
            if parts[3] not in self.namespaces:
                raise kmock.KubernetesObjectNotFoundError()
            return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                "name": parts[3], "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS, parts[3]))}, "status": {"phase": "Active"}})
        if not self.jobset_installed and "/apis/jobset.x-k8s.io" in request.url.path:
            raise kmock.KubernetesEndpointNotFoundError()
        if request.resource is not None and request.resource.plural == "selfsubjectaccessreviews":
            return aiohttp.web.json_response({**request.data, "status": {"allowed": self.access_allowed}}, status=201)
        if request.resource is not None and request.action == enums.action.UPDATE and request.name \
                and not request.subresource and isinstance(request.data, dict):
            await self._validate_patch(request)
        if request.resource is not None and request.resource.plural == "pods" and request.name \
                and request.subresource == "log":
            text = self.logs.get((request.namespace, request.name), "")
            tail = request.params.get("tailLines")
            if tail:
                text = "".join(text.splitlines(keepends=True)[-int(tail):])
            limit = request.params.get("limitBytes")
            if limit:
                text = text.encode()[: int(limit)].decode(errors="ignore")
            return aiohttp.web.Response(text=text, content_type="text/plain")
        if request.resource is not None and request.action == enums.action.DELETE and request.name:
            return await self._delete(request)
        if request.resource is not None and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            if request.action == enums.action.CREATE:
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
                if request.namespace and not meta.get("namespace"):
                    meta["namespace"] = request.namespace
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
                meta["generation"] = 1
                self._fill_type(request)
                if not request.subresource:
                    self._validate(request.data)
            if request.action in (enums.action.CREATE, enums.action.UPDATE):
                meta["resourceVersion"] = str(next(self._rv))
        return await super()._handle(request)

    async def _validate_patch(self, request) -> None:
        """A merge patch must leave a valid object behind (the API server validates the result)."""
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                return
            merged = _merge(json.loads(json.dumps(self._objects[key].raw)), request.data)
        for k in ("uid", "resourceVersion", "creationTimestamp", "generation", "deletionTimestamp"):
            merged.get("metadata", {}).pop(k, None)
        merged.pop("status", None)
        self._validate(merged)

    async def _delete(self, request):
        """Delete with the garbage collector's cascade (dependents by owner uid), or hold it terminating."""
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            raw = self._objects[key].raw
            if self.hold_deletions:
                if not raw.get("metadata", {}).get("deletionTimestamp"):
                    self._objects[key].patch({"metadata": {"deletionTimestamp": _now()}})
                    self.held.append((key, request.data))
                    raw = self._objects[key].raw
                    await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
                return aiohttp.web.json_response(raw)
            await self._cascade(key)
        return aiohttp.web.json_response(raw)

    async def _cascade(self, key) -> None:
        raw = self._objects[key].raw
        self._objects[key].delete()
        await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        uid = raw.get("metadata", {}).get("uid")
        for other_key, obj in list(self._objects.items()):
            if obj.deleted:
                continue
            owners = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if uid and any(o.get("uid") == uid for o in owners):
                await self._cascade(other_key)

    def release_deletions(self) -> None:
        """Finish held deletions (the kubelet and garbage collector catch up)."""
        async def go():
            async with self._lock:
                held, self.held = self.held, []
                for key, _ in held:
                    if key in self._objects and not self._objects[key].deleted:
                        await self._cascade(key)
        asyncio.run_coroutine_threadsafe(go(), self._loop).result(5)

    async def _serve_create(self, request):
        return rendering.Response(status=201, payload=await super()._serve_create(request))

    async def _serve_list(self, request):
        result = await super()._serve_list(request)
        sel, fsel = request.params.get("labelSelector"), request.params.get("fieldSelector")
        result["items"] = [o for o in result["items"]
                           if _selector_ok(o.get("metadata", {}).get("labels"), sel) and _field_ok(o, fsel)]
        result["metadata"] = {"resourceVersion": str(next(self._rv))}
        return result

    async def _serve_watch(self, request):
        sel = request.params.get("labelSelector")
        timeout = float(request.params.get("timeoutSeconds") or 0) or None
        agen = super()._serve_watch(request)
        try:
            async with asyncio.timeout(timeout):
                async for ev in agen:
                    if isinstance(ev, dict) and not _selector_ok(
                            ev.get("object", {}).get("metadata", {}).get("labels"), sel):
                        continue
                    yield ev
        except TimeoutError:
            return
        finally:
            await agen.aclose()

    async def _serve_replace(self, request):
        if request.resource is None or request.name is None or not isinstance(request.data, dict):
            raise kmock.KubernetesEndpointNotFoundError()
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self._objects or self._objects[key].deleted:
                raise kmock.KubernetesObjectNotFoundError()
            old_meta = self._objects[key].raw.get("metadata", {})
            meta = request.data.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "namespace"):
                if k in old_meta:
                    meta[k] = old_meta[k]
            meta["resourceVersion"] = str(next(self._rv))
            self._fill_type(request)
            if not request.subresource:
                self._validate(request.data)
            self._objects[key].create(request.data)
            raw = self._objects[key].raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return raw


class KFakeThread:
    """Run KFake on 127.0.0.1:<random port> in a daemon thread: ``.url``, ``.emulator``, ``.stop()``."""

    def __init__(self) -> None:
        self.ready = threading.Event()

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        async with KFake() as emu, kmock.Server(emu, host="127.0.0.1") as srv:
            emu._loop = asyncio.get_running_loop()
            self.emulator, self.url = emu, str(srv.url).rstrip("/")
            self.ready.set()
            await self._stop.wait()

    def start(self) -> KFakeThread:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "the fake API server did not start"
        return self

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)
