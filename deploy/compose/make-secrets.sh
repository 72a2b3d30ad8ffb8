#!/bin/sh
# The secret files deploy/compose/compose.yaml mounts (at /run/secrets/<name>), made once
# with random values: deploy/compose/secrets/, a folder closed to other users (0700) with
# each file 0400. The containers run as uid 1000 (ratchet's images, Temporal's) or start
# as root (PostgreSQL, MinIO), so the files must belong to uid 1000: run this as uid
# 1000, or as root (it then hands them to uid 1000). An existing file is kept: delete it
# to make a new one (and restart what reads it).
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-$here/secrets}"  # or the folder given (tests)
umask 077
mkdir -p "$dir"
chmod 700 "$dir"

random() { od -An -tx1 -N"$1" /dev/urandom | tr -d ' \n'; }
put() {  # put NAME VALUE: write the file unless it exists
    [ -e "$dir/$1" ] && return 0
    printf '%s' "$2" > "$dir/$1"  # no trailing newline: each reader gets the value exactly
    chmod 400 "$dir/$1"
}

put ray_auth_token "$(random 32)"
put payload.key "$(random 32)"
put postgres_password "$(random 24)"
put minio_root_user "minio-admin"
put minio_root_password "$(random 24)"
if [ ! -e "$dir/s3_credentials" ]; then
    put s3_credentials "[default]
aws_access_key_id = ratchet
aws_secret_access_key = $(random 24)"
fi
pw="$(cat "$dir/postgres_password")"
put registry_url "postgresql+psycopg://ratchet:$pw@postgresql:5432/ratchet_registry"
put mlflow_db_url "postgresql+psycopg://ratchet:$pw@postgresql:5432/mlflow"

if [ "$(id -u)" = 0 ]; then
    chown 1000:1000 "$dir"/*
elif [ "$(id -u)" != 1000 ]; then
    echo "make-secrets: the containers run as uid 1000; run: sudo chown 1000:1000 $dir/*" >&2
fi
echo "secrets in $dir"
