"""Where bundles run and get measured: the harness behind `mtp-bench`, peers (TextLLMRunner,
llama.cpp), reports, the device catalog, cost and prediction (`mtp-predict`), adb and
`mtp-profile` on a phone, and the export's acceptance check."""
