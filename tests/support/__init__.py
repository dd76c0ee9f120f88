"""Test helpers shared across the test folders (a real `kvscope serve` subprocess, CURVE stubs)."""
