"""The CTR model as MLflow logs it: models-from-code, not a pickled Python object.

`registry.mlflow_io.log_ctr_model` logs this file (`python_model=<this path>`); MLflow stores a copy
next to MLmodel and, on `mlflow.pyfunc.load_model`, executes that copy. It only imports the
installed package, so what runs is the package's code, not code shipped inside the model. Our own
loader (`registry.pyfunc.load`) does not execute the stored copy at all: it runs this file as
installed (docs/architecture.md, "Registry entries serving can trust").

Keep it this small: a model logged today is loaded by whatever version of the package is installed
when it is loaded.
"""

import mlflow.models

from pipelines.registry.pyfunc import CTRPyfunc

mlflow.models.set_model(CTRPyfunc())
