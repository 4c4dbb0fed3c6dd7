"""Lab variants: kernels measured slower than the default, or used only by benchmarks and their tests.

The default path (`pallas_kernels.<op>.ops`, the model) never imports this package. A module here registers
its variants with the op's `Variant` registry when imported; benchmarks and tests import the module they time
or check by name (`import pallas_kernels.experimental.<module>`). Moving a variant out of here into the default
path is a measured decision (docs/kernels.md, "Adding a variant")."""
