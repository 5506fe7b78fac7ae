"""The part of a contract frame that a loaded pyfunc takes as input: the columns of its signature.

Holdout and monitoring frames carry more than the model reads (the label, event_ts, ...). Handed to
`predict` as they are, MLflow's schema check logs "Found extra inputs ... not defined in the model
signature" on every call, i.e. once per scored batch, and under Airflow its own stderr handler turns
each of those lines into an ERROR record of the task log. Every evaluation call site cuts the frame
here first, so what is scored is exactly what serving sends.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pipelines.data.schema import FEATURE_FIELDS


def input_columns(model) -> list[str]:
    """The input column names of `model`'s signature, in signature order; FEATURE_FIELDS (what the
    CTR pyfunc reads, and what `registry.mlflow_io.input_example` logs) for a model without one."""
    schema = model.metadata.get_input_schema()
    if schema is not None and schema.has_input_names():
        return [str(c) for c in schema.input_names()]
    return list(FEATURE_FIELDS)


def model_input(model, frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` cut to `model`'s input columns. A column the frame lacks is left out rather than
    raised on here, so the model's own schema check names every missing input in its error."""
    return frame.loc[:, [c for c in input_columns(model) if c in frame.columns]]


def predict_pctr(model, frame: pd.DataFrame) -> np.ndarray:
    """pCTR of every row of `frame` from a loaded pyfunc, given only its input columns."""
    return np.asarray(model.predict(model_input(model, frame)), dtype=np.float64)
