"""The quality bench (``python -m app.bench.quality``): a recipe's AUC beside a logistic-regression baseline's."""
