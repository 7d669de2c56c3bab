"""Helpers the test modules share (a test module imports from here, never from another test module)."""
