"""The test suite, grouped like the app/ package tree; helpers several groups use sit here beside conftest.py."""
