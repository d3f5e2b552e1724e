"""The training system: the LightningModule and what a training step is made of.

``module`` (``DLRMModule``: the DLRM, the click loss, the optimizers, the metrics), ``pipeline``
(the plain or TorchRec-pipelined step), ``optimizers`` (fused sparse, dense, and the one Lightning
steps), ``lr_schedule`` (warm-up and decay), ``metrics`` (exact or binned AUC, log loss, NE,
calibration), ``log_steps`` (logging only on the steps Lightning writes), ``callbacks`` (samples/s,
the predictions file), ``loggers`` (CSV and TensorBoard under the run's folder).
"""
