#!/bin/sh
# Create Temporal's two databases on the compose PostgreSQL and bring their schemas to the
# version this admin-tools image ships (what the retired auto-setup image did at start).
# Idempotent: `create` and `setup-schema` fail harmlessly on a database that has them,
# `update-schema` applies only what is missing. The password comes from the file
# SQL_PASSWORD_FILE names (a compose secret), into this script's own environment only.
set -eu
: "${POSTGRES_SEEDS:?}" "${POSTGRES_USER:?}" "${SQL_PASSWORD_FILE:?}"
SQL_PASSWORD="$(cat "$SQL_PASSWORD_FILE")"
export SQL_PASSWORD
schema=/etc/temporal/schema/postgresql/v12
tool() { temporal-sql-tool --plugin postgres12 --ep "$POSTGRES_SEEDS" -p "${DB_PORT:-5432}" -u "$POSTGRES_USER" "$@"; }
for pair in temporal:temporal temporal_visibility:visibility; do
    db="${pair%%:*}"
    dir="${pair##*:}"
    tool --db "$db" create >/dev/null 2>&1 || echo "database $db exists"
    tool --db "$db" setup-schema -v 0.0 >/dev/null 2>&1 || echo "schema of $db already set up"
    tool --db "$db" update-schema -d "$schema/$dir/versioned"
done
echo "Temporal schemas ready"
