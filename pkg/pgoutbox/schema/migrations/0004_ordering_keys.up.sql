-- Per-key FIFO: a keyed row is claimable only while no older row of its
-- key is present.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS ordering_key text;
{{- if .DLQ}}

ALTER TABLE {{.DLQ}} ADD COLUMN IF NOT EXISTS ordering_key text;
{{- end}}

-- The claim probes it for an older row of a key.
CREATE INDEX IF NOT EXISTS {{idx "_group_order_idx"}} ON {{.Table}} (topic, consumer_group, ordering_key, id) WHERE ordering_key IS NOT NULL;

-- Keys with a leased row: whatever its id (a row committed late, a
-- requeued dead letter), no other row of the key may be claimed meanwhile.
CREATE INDEX IF NOT EXISTS {{idx "_group_order_lease_idx"}} ON {{.Table}} (topic, consumer_group, ordering_key) WHERE ordering_key IS NOT NULL AND lease_token IS NOT NULL;
