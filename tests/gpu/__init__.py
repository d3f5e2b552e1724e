"""The GPU suite (make test-gpu): every test is marked gpu and skips, with the reason, without a usable GPU."""
