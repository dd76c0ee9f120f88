"""Tests of the window in a real X server (Xvfb, QT_QPA_PLATFORM=xcb), run on their own."""
