"""The data road, from Criteo files to ``KeyedJaggedTensor`` batches.

``datamodule`` (``CriteoDataModule``, the LightningDataModule), ``splits`` (which files each stage
reads), ``paths`` (globs, folders, lists), ``formats`` (opening raw TSV, NumPy days or multi-hot
days), ``source`` (the row interface every format provides), the raw TSV reader in ``tsv``
(entry points), ``tsv_stream`` (files -> blocks of lines) and ``tsv_decode`` (a block -> arrays),
``cache`` (raw TSV -> fingerprinted NumPy days, by ``preprocess``), ``lock_file`` (a lock file naming
its holder, safe on storage that several nodes share), ``frequency_threshold`` (the
training vocabulary of ``data.frequency_threshold`` and the cached days mapped with it), ``preprocess`` (the conversion,
also ``python -m app.data.preprocess``), ``numpy_days`` and ``multi_hot`` (memory-mapped day
files), ``partition`` and ``dataset`` (each rank's slice of each global batch), ``loader`` (the
resumable loader), ``batches`` (``KeyedJaggedTensor`` batches), ``synthetic`` (the sample generator).
"""
