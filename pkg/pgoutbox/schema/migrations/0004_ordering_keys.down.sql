-- Messages keep flowing, without their order per key.
DROP INDEX IF EXISTS {{.QOrderLeaseIdx}}, {{.QOrderIdx}};

ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS ordering_key;
{{- if .DLQ}}

ALTER TABLE {{.DLQ}} DROP COLUMN IF EXISTS ordering_key;
{{- end}}
