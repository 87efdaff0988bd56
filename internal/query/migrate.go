package query

import "fmt"

// VersionTable creates the table of applied schema versions: one row per
// version, so a status shows when each was applied.
func VersionTable(n Names) string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)`, n.QVersions)
}

// VersionsApplied lists the recorded versions, oldest first.
func VersionsApplied(n Names) string {
	return fmt.Sprintf(`SELECT version, name, applied_at FROM %s ORDER BY version`, n.QVersions)
}

// RecordVersion records one applied version; recording it again changes
// nothing.
func RecordVersion(n Names) string {
	return fmt.Sprintf(`INSERT INTO %s (version, name) VALUES ($1, $2) ON CONFLICT (version) DO NOTHING`, n.QVersions)
}

// ForgetVersion removes a version a down migration undid.
func ForgetVersion(n Names) string {
	return fmt.Sprintf(`DELETE FROM %s WHERE version = $1`, n.QVersions)
}

// TableExists tells whether a table (or any relation) exists: $1 is its
// quoted, schema-qualified name.
const TableExists = `SELECT to_regclass($1) IS NOT NULL`

// NamedGroupRows tells whether the outbox holds rows of a named consumer
// group: version 3's down migration refuses then.
func NamedGroupRows(n Names) string {
	return fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE consumer_group <> '')`, n.QTable)
}

// AnyRow tells whether a table holds a row: qtable is its quoted,
// schema-qualified name, and the table must exist.
func AnyRow(qtable string) string {
	return fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s)`, qtable)
}
