# A real S3 server for the compose check and smoke (deploy/compose/check.yml): Ceph's radosgw on a
# one-node cluster (one monitor, one memstore OSD: objects live in memory and vanish with the
# container), from Debian's packages. It stands in for MinIO, whose image cannot be had where no
# registry is reachable; users keep MinIO (docker-compose.yml) or their own S3 server.
#   docker build -f deploy/compose/radosgw.Dockerfile --build-arg BASE_IMAGE=<base> -t stitchboard/s3-radosgw:16 .
# Settings: S3_ACCESS_KEY_ID / S3_SECRET_ACCESS_KEY (the one S3 user, created at start), S3_PORT (9000).
ARG BASE_IMAGE=debian:bookworm-20250520-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends radosgw ceph-mon ceph-osd curl \
    && rm -rf /var/lib/apt/lists/*
COPY --chmod=0755 deploy/compose/radosgw-start.sh /usr/local/bin/radosgw-start
EXPOSE 9000
HEALTHCHECK --interval=2s --timeout=3s --retries=60 CMD ["curl", "-fsS", "-o", "/dev/null", "http://127.0.0.1:9000/"]
ENTRYPOINT ["radosgw-start"]
