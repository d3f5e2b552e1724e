"""``python -m app.bench``: the app against a plain TorchRec training loop, side by side, on the same
model, data, batch, optimizers and sharding plan; one JSON line per run and the ratio of the two."""
