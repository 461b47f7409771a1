"""One-shot of the compose check and smoke (deploy/compose/check.yml): create the bucket BUCKET on the S3
server at S3_ENDPOINT_URL with the keys S3_ACCESS_KEY_ID / S3_SECRET_ACCESS_KEY, unless it exists. Runs in
the bulletin image (boto3). Exits non-zero, naming the bucket and the server's error, when it cannot."""

import os
import sys

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

bucket, endpoint = os.environ["BUCKET"], os.environ["S3_ENDPOINT_URL"]
s3 = boto3.client(
    "s3",
    endpoint_url=endpoint,
    region_name="us-east-1",
    aws_access_key_id=os.environ["S3_ACCESS_KEY_ID"],
    aws_secret_access_key=os.environ["S3_SECRET_ACCESS_KEY"],
    config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5}),
)
try:
    s3.create_bucket(Bucket=bucket)
    print(f"create-bucket: created bucket {bucket} on {endpoint}")
except ClientError as exc:
    if exc.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
        sys.exit(f"create-bucket: cannot create bucket {bucket} on {endpoint}: {exc}")
    print(f"create-bucket: bucket {bucket} exists on {endpoint}")
except BotoCoreError as exc:
    sys.exit(f"create-bucket: cannot reach the S3 server {endpoint} for bucket {bucket}: {exc}")
