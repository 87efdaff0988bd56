-- Messages keep flowing, without their order per key.
DROP INDEX IF EXISTS {{qidx "_group_order_lease_idx"}}, {{qidx "_group_order_idx"}};

ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS ordering_key;
{{- if .DLQ}}

ALTER TABLE {{.DLQ}} DROP COLUMN IF EXISTS ordering_key;
{{- end}}
