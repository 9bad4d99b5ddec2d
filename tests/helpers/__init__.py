"""Shared helpers of the jaxslice tests: oracles and checks (`oracles`), the model zoo
(`models`), the NNX tests' models (`nnx_zoo`), the fuzzers' shared pieces (`fuzzing`,
`fuzz_scan`) and the NumPy reference of the adjacent-layer coverage criteria
(`coverage_reference`). See tests/README.md."""
