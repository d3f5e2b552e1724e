"""Tests of app/model: the DLRM variants and their compiled dense layers."""
