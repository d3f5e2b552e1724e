"""The distributed machinery: processes, the sharding plan, and the strategy that ties them to Lightning.

``strategy`` (``TorchRecStrategy``: process group, planning, ``DistributedModelParallel``, sharded
saves and loads), ``sharding`` (the planner's inputs and planning on rank 0), ``topology``
(hardware presets for the planner), ``plan_report`` (``sharding_plan.json`` / ``.txt``),
``rendezvous`` (joining the process group within a timeout), ``launch`` (launch-size checks, NCCL
error-handling defaults, the launcher whose ranks end with it), ``job_lifetime`` (a rank follows its
launcher; the job's id; who holds a port), ``threads`` (intra-op threads per process), ``health``
(per-rank step times, the slow-rank warning).
"""
