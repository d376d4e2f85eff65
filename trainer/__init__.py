"""The training side: the launcher, the shim, the example model and the SDK's internals (no Django).

Two library messages would otherwise open and close every job's log with something that is not true
for it; both are silenced here, once, before anything imports torch or NVRx (every process of a job
imports this package first: the launcher, its fork server and each rank):

- pynvml 13 (which nvidia-resiliency-ext requires) is a shim over nvidia-ml-py that warns "The pynvml
  package is deprecated" each time ``torch.cuda`` imports it. Nothing a user does can act on it (NVRx
  pins the package), so that one FutureWarning is ignored.
- NVRx's rank monitor logs ``[NestedRestarter] name=[InJob] state=aborted`` whenever it is shut down
  while its rank is gone, which is how every run ends, a clean finish included (the rank exits, the
  monitor reads that as the start of a restart, then the launcher stops it). That line serves NVRx's
  nested-restarter log protocol, which Unbroken does not use; how a run ended is logged by the
  launcher and reported to the control plane, so that one line is dropped.
"""

import logging
import warnings

warnings.filterwarnings("ignore", message="The pynvml package is deprecated", category=FutureWarning)


class _NoShutdownAbort(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "state=aborted" not in str(record.msg)


logging.getLogger("RankMonServer.Restarter").addFilter(_NoShutdownAbort())
