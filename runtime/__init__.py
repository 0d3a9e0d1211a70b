"""Run time: the draft-verify loop, samplers, drafters, one session module per backend, opening a
bundle, assembly (a bundle or a model + a drafter choice -> a ready generator), the compiled
attention kernel, and `mtp-runner`, which builds and runs the C++ core in runtime/native/."""
