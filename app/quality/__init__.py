"""The quality bench (``python -m app.quality``): a recipe's AUC beside a logistic-regression baseline's."""
