"""stitchboard.bulletin: where trainers publish versions and rollout engines find them.

Module tree (module -> what it holds -> which process uses it)::

    bulletin/
    ├── app.py              create_app: the FastAPI app, ops routes, error handlers   bulletin service
    ├── deps.py             BulletinState, the Read/Publish token-checking dependencies  bulletin service
    ├── routes_versions.py  publish, latest (long-poll), manifest, version pages, runs, plan
    ├── routes_blobs.py     blob upload (verified while receiving), download, presigned URLs
    ├── ledger.py           versions as store objects: the commit point, latest pointer    service, gc
    ├── longpoll.py         Watcher: wakes long-polls on publishes, polls for other processes
    ├── planner.py          make_plan: cheapest deltas / anchor route between two versions
    ├── retention.py        the retention policy and its garbage collector                 `bulletin gc`
    ├── auth.py             Authorizer: bearer tokens, read/publish scopes per run
    ├── metrics.py          Prometheus metrics and the latency middleware
    ├── settings.py         BulletinSettings (STITCH_BULLETIN_* env vars)
    ├── stores/             the Store protocol, FileStore, S3Store (+ S3Settings), open_store
    ├── errors.py           the BulletinError tree, error_from_body            service and client
    ├── client.py           BulletinClient over HTTP (httpx only)      trainer, sidecar, CLIs
    ├── cli.py              `stitchboard bulletin serve|gc`
    ├── versions_cli.py     `stitchboard versions latest|list|show|plan` (client only)
    ├── cli_options.py      --bulletin/--token/--run of every client CLI (STITCH_CLIENT_* env vars)
    ├── store.py            old import path of stores (FileStore, Store, open_store)
    └── s3store.py          old import path of stores.s3 (S3Store)

Imports point one way: app -> routes -> deps -> ledger/longpoll/auth/metrics -> stores ->
errors; the client imports only errors and :mod:`stitchboard.proto`. Wire bodies live in
:mod:`stitchboard.proto` (schema, answers).
"""
