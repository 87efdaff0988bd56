// Package catalogtest describes a schema's layout as sorted lines, for the
// tests that compare what schema.Create makes with what the migrations
// make (in the schema package, and through goose and golang-migrate in
// tests/migrations).
package catalogtest

import "strings"

// DumpSQL is a statement whose rows describe every relation of schema $1:
// columns (type, nullability, default, identity), relations with their
// storage parameters, indexes and constraints, one sorted line each, with
// the schema name replaced by S. Lines naming a table of skip (the
// version tables of pgoutbox and of migration tools) are left out. Column
// order is left out too: a migration adds columns at the end where Create
// declares them in place.
func DumpSQL(skip ...string) string {
	var where []string
	for _, table := range skip {
		where = append(where, "line NOT LIKE '%"+table+"%'")
	}
	filter := ""
	if len(where) > 0 {
		filter = "WHERE " + strings.Join(where, " AND ")
	}
	return `
SELECT line FROM (
  SELECT c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
         || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
         || coalesce(' default ' || replace(pg_get_expr(d.adbin, d.adrelid), quote_ident($1) || '.', 'S.'), '')
         || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END AS line
    FROM pg_attribute a
    JOIN pg_class c ON c.oid = a.attrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
   WHERE n.nspname = $1 AND c.relkind = 'r' AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT 'relation ' || c.relname || ' ' || c.relkind::text || ' ' || coalesce(array_to_string(c.reloptions, ','), '')
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1
  UNION ALL
  SELECT 'index ' || replace(indexdef, quote_ident($1) || '.', 'S.') FROM pg_indexes WHERE schemaname = $1
  UNION ALL
  SELECT 'constraint ' || c.relname || ' ' || con.conname || ' ' || pg_get_constraintdef(con.oid)
    FROM pg_constraint con JOIN pg_class c ON c.oid = con.conrelid JOIN pg_namespace n ON n.oid = c.relnamespace
   WHERE n.nspname = $1
) l ` + filter + `
ORDER BY line`
}
