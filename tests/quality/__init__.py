"""Tests of app/quality: the recipe beside the logistic-regression baseline."""
