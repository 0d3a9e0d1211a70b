"""Where bundles run and get measured: the host harness behind `mtp-bench` (adb devices later)."""
