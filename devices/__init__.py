"""Where bundles run and get measured: the harness behind `mtp-bench` (plain vs speculative on
one backend), its run over one setup here or several side by side in worker processes, the
peers (ExecuTorch's TextLLMRunner, llama.cpp), its Markdown and PNG report, the device catalog,
cost and roofline prediction (`mtp-predict`), adb and `mtp-profile` (on this machine or a
phone), and the drafter's acceptance that the export's quality report compares."""
