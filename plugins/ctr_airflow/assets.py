"""The Airflow Asset the daily DAGs schedule on (import-light: DAG files import it at parse time).

`VALIDATED` gets one event per click-log partition that `ctr_lake_arrival` found in the lake and
validated, with `extra={"day": "YYYY-MM-DD", "lake_uri": "<lake>"}`. `ctr_lora_retrain`,
`ctr_cold_start` and `ctr_champion_monitor` are scheduled on it (`schedule=[VALIDATED]`) and read
the day and lake of their run from that extra (`ctr_airflow.runtime.run_day` / `pipeline_config`).
The URI names the event, not a location: the same asset serves every lake (the extra says which).
Its scheme starts with `x-`, Airflow's convention for a scheme no provider normalises: the URI is
taken as is, without loading every provider's URI handlers at parse time (a quarter of a second).
"""

from __future__ import annotations

from airflow.sdk import Asset

VALIDATED = Asset(name="ctr_lake_validated", uri="x-ctr-lake://clicks/validated")
