-- Drops the tables and every message in them. The schema stays: it may
-- hold other tables.
{{- if .DLQ}}
DROP TABLE IF EXISTS {{.DLQ}};
{{- end}}

DROP TABLE IF EXISTS {{.Table}};
