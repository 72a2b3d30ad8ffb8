-- Runs once, when the PostgreSQL volume is new (the image's /docker-entrypoint-initdb.d).
-- The registry's database is POSTGRES_DB (ratchet_registry); Temporal's two databases are
-- created by the temporal-schema job; MLflow's store is this one.
CREATE DATABASE mlflow;
