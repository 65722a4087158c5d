"""Independent reference implementations used by the test suite (never the code under test)."""
