"""Readers of tables: DLRM traces (dlrm), table-spec files (spec) and the synthetic generator (synthetic).
The ingest stage that writes tables.parquet is embshard.jobs.ingest.
"""
