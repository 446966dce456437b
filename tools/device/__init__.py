"""Jobs for the lent GPU machine: kernel benchmarks, tuning, compile checks, plugin end-to-end runs and their
shell runners."""
