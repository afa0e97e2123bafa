"""A model that lives outside torchacco: copied by tests/test_model_parallel.py into a temporary
package and trained as `[model] name = "<package>.toy"`, tensor parallel included."""

from torchacco.spec import ModelSpec

from . import parallelize
from .model import Toy, ToyArgs

spec = ModelSpec(
    name="toy",
    model_cls=Toy,
    flavors={"debug": ToyArgs()},
    tensor_parallel=parallelize.tensor_parallel,
)
