"""Development tools of the repository (not in the wheel): environment set-up, deploy maintenance, the GPU-machine
runner and the reference-model pipeline. A package only so that tests import these modules by name."""
