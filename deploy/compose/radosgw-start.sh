#!/bin/sh
# Entry point of the radosgw image (deploy/compose/radosgw.Dockerfile): a one-node Ceph cluster and
# radosgw on 0.0.0.0:$S3_PORT, with one S3 user whose keys are S3_ACCESS_KEY_ID / S3_SECRET_ACCESS_KEY.
# The same steps as the tests' fixture (tests/support/radosgw.py, whose docstring says why each is
# needed), for a container: fixed ports, the data in /var/lib/stitch-ceph, radosgw in the foreground.
set -eu

: "${S3_ACCESS_KEY_ID:?set S3_ACCESS_KEY_ID (the S3 user this server creates)}"
: "${S3_SECRET_ACCESS_KEY:?set S3_SECRET_ACCESS_KEY (the S3 user this server creates)}"
port="${S3_PORT:-9000}"
root=/var/lib/stitch-ceph
rm -rf "$root"
mkdir -p "$root/run" "$root/log" "$root/mon" "$root/osd" "$root/rgw"
fsid=$(cat /proc/sys/kernel/random/uuid)
osd_uuid=$(cat /proc/sys/kernel/random/uuid)
conf="$root/ceph.conf"
cat >"$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:3300
auth cluster required = none
auth service required = none
auth client required = none
ms mon client mode = crc
keyring = /dev/null
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
osd crush update on start = false
osd class update on start = false
paxos propose interval = 0.01
ms bind ipv6 = false
run dir = $root/run
admin socket = $root/run/\$name.asok
log file = $root/log/\$name.log
[mon.a]
mon data = $root/mon
[osd.0]
osd data = $root/osd
osd objectstore = memstore
[client.rgw]
rgw data = $root/rgw
rgw frontends = beast endpoint=0.0.0.0:$port tcp_nodelay=1
CONF

echo "s3: starting a one-node Ceph cluster"
monmaptool --create --addv a "[v2:127.0.0.1:3300]" --fsid "$fsid" "$root/monmap" >/dev/null
ceph-mon -c "$conf" --mkfs -i a --monmap "$root/monmap"
ceph-osd -c "$conf" -i 0 --mkfs --osd-uuid "$osd_uuid" --no-mon-config >/dev/null 2>&1
ceph-mon -c "$conf" -i a -f &
{
	echo "osd new $osd_uuid 0"
	echo "osd crush add osd.0 1.0 host=localhost root=default"
	for pool in .rgw.root default.rgw.control default.rgw.meta default.rgw.log default.rgw.buckets.index \
		default.rgw.buckets.data default.rgw.buckets.non-ec; do
		echo "osd pool create $pool 8 8"
	done
} | ceph -c "$conf" --connect-timeout 60 >/dev/null
ceph-osd -c "$conf" -i 0 -f &
# radosgw-admin waits until the OSD is up and its placement groups are active (a RADOS write).
(
	radosgw-admin -c "$conf" -n client.rgw user create --uid stitch --display-name stitch \
		--access-key "$S3_ACCESS_KEY_ID" --secret "$S3_SECRET_ACCESS_KEY" >/dev/null
	echo "s3: radosgw listens on :$port, S3 user with access key $S3_ACCESS_KEY_ID created"
	touch "$root/ready"
) &
exec radosgw -c "$conf" -n client.rgw -f
