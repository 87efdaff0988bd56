package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/pgoutboxtest"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// cliOnNewSchema is an empty schema of the test's own, and a runner of the
// CLI with its connection flags.
func cliOnNewSchema(t *testing.T) (*pgoutboxtest.Schema, func(args ...string) (string, string, int)) {
	t.Helper()
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	conn := []string{"--dsn", s.DSN, "--schema", s.Name}
	return s, func(args ...string) (string, string, int) {
		t.Helper()
		return cliRun(t, nil, append(args, conn...)...)
	}
}

func TestSchemaMigrate(t *testing.T) {
	t.Parallel()
	s, run := cliOnNewSchema(t)
	status := func() map[string]any {
		t.Helper()
		out, errOut, code := run("schema", "migrate", "status", "--json")
		require.Equal(t, 0, code, errOut)
		var doc map[string]any
		require.NoError(t, json.Unmarshal([]byte(out), &doc), out)
		return doc
	}
	latest := float64(schema.LatestVersion())

	doc := status()
	require.Equal(t, 0.0, doc["current"])
	require.Equal(t, latest, doc["latest"])
	require.Len(t, doc["pending"], int(latest))
	require.Equal(t, false, doc["needs_baseline"])
	// A mistyped --table read as a fresh outbox at version 0, silently.
	out, _, code := run("schema", "migrate", "status")
	require.Equal(t, 0, code)
	require.Contains(t, out, "there is no table")
	require.Contains(t, out, "pass its --schema and --table")

	out, errOut, code := run("schema", "migrate", "up", "--dry-run")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "-- apply version 1 (initial)\n")
	require.Contains(t, out, "-- apply version 4 (ordering_keys)\n")
	require.Contains(t, out, `CREATE TABLE IF NOT EXISTS "`+s.Name+`"."outbox"`)
	require.Equal(t, 0.0, status()["current"], "a dry run changes nothing")

	out, errOut, code = run("schema", "migrate", "up", "--to", "2", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Equal(t, "applied version 1 (initial)\napplied version 2 (lease_holder_parking)\n", out)
	out, errOut, code = run("schema", "migrate", "up")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "applied version 4 (ordering_keys)")
	_, errOut, code = run("schema", "validate")
	require.Equal(t, 0, code, errOut)
	out, _, code = run("schema", "migrate", "status")
	require.Equal(t, 0, code)
	require.Contains(t, out, "version 7 of 7")
	// Times in local time with their zone, as every table prints them.
	applied := regexp.MustCompile(`(?m)^  applied +1 initial +(.+)$`).FindStringSubmatch(out)
	require.Len(t, applied, 2, out)
	_, err := time.ParseInLocation(listTimeLayout, applied[1], time.Local)
	require.NoError(t, err, "the applied time is printed as the tables print times")
	out, _, _ = run("schema", "migrate", "up")
	require.Contains(t, out, "nothing to do")
	require.Empty(t, status()["catalog_problems"])

	// A process of the first release that runs its schema.Create after the
	// upgrade puts its dedup index back; the recorded version cannot show
	// it, the catalog does.
	_, err = s.Pool.Exec(context.Background(), `CREATE UNIQUE INDEX outbox_dedup_idx ON "`+s.Name+`".outbox (topic, dedup_key) WHERE dedup_key IS NOT NULL`)
	require.NoError(t, err)
	out, _, code = run("schema", "migrate", "status")
	require.Equal(t, 0, code)
	require.Contains(t, out, "version 7 of 7\nbut the catalog differs from that version: index outbox_dedup_idx on outbox is left from the first release")
	require.Contains(t, out, `"pgoutbox schema apply", with the names and flags the deployment uses`)
	require.Len(t, status()["catalog_problems"], 1)
	out, _, _ = run("schema", "migrate", "up")
	require.Contains(t, out, "nothing to do")
	require.Contains(t, out, "outbox_dedup_idx")
	_, err = s.Pool.Exec(context.Background(), `DROP INDEX "`+s.Name+`".outbox_dedup_idx`)
	require.NoError(t, err)

	_, errOut, code = run("schema", "migrate", "down")
	require.Equal(t, exitRefused, code, "down asks, and there is no terminal")
	require.Contains(t, errOut, "--yes")
	out, errOut, code = run("schema", "migrate", "down", "--dry-run")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "-- undo version 7 (arrivals)\n")
	require.Contains(t, out, "\nALTER TABLE")
	out, errOut, code = run("schema", "migrate", "down", "--yes")
	require.Equal(t, 0, code, errOut)
	require.Equal(t, "undid version 7 (arrivals)\n", out)
	require.Equal(t, 6.0, status()["current"])

	_, errOut, code = run("schema", "migrate", "down", "--to", "7")
	require.Equal(t, exitUsage, code)
	require.Contains(t, errOut, "above the current version 6")
	_, _, code = run("schema", "migrate", "up", "--to", "99")
	require.Equal(t, exitUsage, code)

	// Version 0 drops the tables: only when asked for by name, and not
	// over messages unless --drop-messages says so (--yes answers the
	// question, a script's usual flag).
	out, errOut, code = run("schema", "migrate", "down", "--to", "1", "--yes")
	require.Equal(t, 0, code, errOut)
	_, errOut, code = run("schema", "migrate", "down", "--yes")
	require.Equal(t, exitUsage, code, "down alone from version 1")
	require.Contains(t, errOut, "give --to 0")
	_, err = s.Pool.Exec(context.Background(), `INSERT INTO "`+s.Name+`".outbox (topic, uuid, payload) VALUES ('kept', 'u1', 'x')`)
	require.NoError(t, err)
	_, errOut, code = run("schema", "migrate", "down", "--to", "0", "--yes")
	require.Equal(t, exitRefused, code)
	require.Contains(t, errOut, "holds rows")
	require.Contains(t, errOut, "--drop-messages")
	require.Equal(t, 1.0, status()["current"], "nothing undone")
	out, errOut, code = run("schema", "migrate", "down", "--to", "0", "--yes", "--drop-messages")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "undid version 1 (initial)")
	_, _, code = run("schema", "validate")
	require.Equal(t, exitValidation, code)

	// An outbox made by an older Create: tables without a version.
	require.NoError(t, schema.Create(context.Background(), tx.FromPgxPool(s.Pool), schema.Config{Schema: s.Name}))
	_, err = s.Pool.Exec(context.Background(), `DROP TABLE "`+s.Name+`".outbox_schema_version`)
	require.NoError(t, err)
	require.Equal(t, true, status()["needs_baseline"])
	require.Equal(t, latest, status()["layout_version"], "the catalog tells the layout's version")
	require.Empty(t, status()["pending"], "and that nothing is pending")
	out, errOut, code = run("schema", "migrate", "status")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "the layout of version 7: up to date")
	require.Contains(t, out, "goose status", "an outbox goose manages records nothing here: say whose status to read")
	_, errOut, code = run("schema", "migrate", "up")
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "migrate baseline")
	out, errOut, code = run("schema", "migrate", "baseline")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "recorded version 7")
	require.Equal(t, latest, status()["current"])
}

func TestSchemaMigrateFiles(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	out, errOut, code := cliRun(t, nil, "schema", "migrate", "files", "--format", "goose", "--out", dir, "--schema", "app")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, filepath.Join(dir, "0001_initial.sql"))
	text, err := os.ReadFile(filepath.Join(dir, "0003_consumer_groups.sql"))
	require.NoError(t, err)
	require.Contains(t, string(text), "-- +goose Up")
	require.Contains(t, string(text), `"app"."outbox_bindings"`)
	_, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "goose", "--out", dir, "--schema", "app")
	require.Equal(t, 0, code, "the same files again: %s", errOut)
	// Another outbox's files: the names say so, and nothing is written.
	before, err := os.ReadDir(dir)
	require.NoError(t, err)
	_, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "goose", "--out", dir, "--schema", "other")
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "0001_initial.sql was rendered for another outbox")
	require.Contains(t, errOut, `it names "app"."outbox"`)
	require.Contains(t, errOut, `these files name "other"."outbox"`)
	require.Contains(t, errOut, "a directory of their own")
	require.NotContains(t, errOut, "already applied")
	after, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Equal(t, len(before), len(after))
	_, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "goose", "--out", dir, "--schema", "app", "--no-dlq")
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, `it names "app"."outbox_dlq"`, "rendered with a dead-letter table")
	require.Contains(t, errOut, "--no-dlq")

	// A file changed since: the same names, other content.
	last := filepath.Join(dir, "0007_arrivals.sql")
	text, err = os.ReadFile(last)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(last, append(text, "-- edited\n"...), 0o644))
	_, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "goose", "--out", dir, "--schema", "app")
	require.Equal(t, exitError, code)
	require.Contains(t, errOut, "0007_arrivals.sql exists with other content; a migration already applied must not change")

	// Files an earlier release wrote (version 1 created the schema with a
	// bare CREATE SCHEMA IF NOT EXISTS), one version behind: the earlier
	// rendering is kept, the missing version written.
	early := t.TempDir()
	_, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "golang-migrate", "--out", early, "--schema", "app")
	require.Equal(t, 0, code, errOut)
	first := filepath.Join(early, "0001_initial.up.sql")
	text, err = os.ReadFile(first)
	require.NoError(t, err)
	guarded := regexp.MustCompile(`(?s)DO \$pgoutbox\$ BEGIN.*?END \$pgoutbox\$`)
	require.Regexp(t, guarded, string(text))
	earlier := guarded.ReplaceAllLiteralString(string(text), `CREATE SCHEMA IF NOT EXISTS "app"`)
	require.NoError(t, os.WriteFile(first, []byte(earlier), 0o644))
	missing, err := filepath.Glob(filepath.Join(early, "0007_*"))
	require.NoError(t, err)
	for _, m := range missing {
		require.NoError(t, os.Remove(m))
	}
	out, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "golang-migrate", "--out", early, "--schema", "app")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "0001_initial.up.sql kept: an earlier rendering of the same migration")
	require.Contains(t, out, "0007_arrivals.up.sql")
	kept, err := os.ReadFile(first)
	require.NoError(t, err)
	require.Equal(t, earlier, string(kept), "an applied migration does not change")

	gm := t.TempDir()
	_, errOut, code = cliRun(t, nil, "schema", "migrate", "files", "--format", "golang-migrate", "--out", gm, "--no-dlq")
	require.Equal(t, 0, code, errOut)
	names, err := filepath.Glob(filepath.Join(gm, "*.sql"))
	require.NoError(t, err)
	require.Len(t, names, 2*schema.LatestVersion())

	for _, args := range [][]string{
		{"schema", "migrate"},
		{"schema", "migrate", "sideways"},
		{"schema", "migrate", "files", "--out", gm},
		{"schema", "migrate", "files", "--format", "flyway", "--out", gm},
		{"schema", "migrate", "down", "--to", "-1"}, // -1 is no version
		{"stats", "--interval", "5s"},               // without --watch
	} {
		_, errOut, code := cliRun(t, nil, args...)
		require.Equal(t, exitUsage, code, "%v: %s", args, errOut)
	}
}

// TestSchemaMigrateDownRefusesUpFront: a down migration past a step that
// refuses undoes nothing, and its dry run says so.
func TestSchemaMigrateDownRefusesUpFront(t *testing.T) {
	t.Parallel()
	s, run := cliOnNewSchema(t)
	_, errOut, code := run("schema", "migrate", "up")
	require.Equal(t, 0, code, errOut)
	_, err := s.Pool.Exec(context.Background(), `INSERT INTO "`+s.Name+`".outbox (topic, consumer_group, uuid, payload, ordering_key) VALUES ('orders', 'billing', 'u1', 'x', 'k1')`)
	require.NoError(t, err)

	out, errOut, code := run("schema", "migrate", "down", "--to", "2", "--dry-run")
	require.Equal(t, exitError, code, out)
	require.Contains(t, errOut, "version 3 (consumer_groups) cannot be undone")
	require.Contains(t, errOut, "unbind those groups with --purge")
	require.Contains(t, errOut, "nothing is undone")

	out, errOut, code = run("schema", "migrate", "down", "--to", "2", "--yes")
	require.Equal(t, exitError, code)
	require.Empty(t, out, "no step undone")
	require.Contains(t, errOut, "refused before the first step: nothing is undone")
	out, _, code = run("schema", "migrate", "status")
	require.Equal(t, 0, code)
	require.Contains(t, out, "version 7 of 7")
}

// TestSchemaMigrateBaselineDryRun: goose and golang-migrate users learn
// the version to mark applied without a version recorded in pgoutbox's
// table.
func TestSchemaMigrateBaselineDryRun(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	exec := tx.FromPgxPool(s.Pool)
	unversioned := func(cfg schema.Config, v int) {
		t.Helper()
		_, err := schema.Migrate(ctx, exec, cfg, v)
		require.NoError(t, err)
		_, err = s.Pool.Exec(ctx, `DROP TABLE "`+s.Name+`"."`+cfg.Table+`_schema_version"`)
		require.NoError(t, err)
	}
	baseline := func(table string, json bool) (string, string, int) {
		t.Helper()
		args := []string{"schema", "migrate", "baseline", "--dry-run", "--dsn", s.DSN, "--schema", s.Name, "--table", table}
		if json {
			args = append(args, "--json")
		}
		return cliRun(t, nil, args...)
	}

	unversioned(schema.Config{Schema: s.Name, Table: "four"}, 4)
	out, errOut, code := baseline("four", false)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "has the layout of version 4 (of 7); recorded nothing")
	require.Contains(t, out, "goose or golang-migrate: mark versions 1 to 4 applied (N = 4)")
	out, errOut, code = baseline("four", true)
	require.Equal(t, 0, code, errOut)
	var doc map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &doc), out)
	require.Equal(t, map[string]any{"version": 4.0, "latest": 7.0, "recorded": false, "dead_letter_table_missing": false, "tool_version": 4.0}, doc)
	st, err := schema.MigrationStatus(ctx, exec, schema.Config{Schema: s.Name, Table: "four"})
	require.NoError(t, err)
	require.Equal(t, 0, st.Current, "nothing recorded")
	require.False(t, tableExists(t, s, "four_schema_version"))

	// The first release's layout without its dead-letter table: a tool
	// marks nothing, so that its version 1 makes the table.
	unversioned(schema.Config{Schema: s.Name, Table: "first", NoDeadLetterTable: true}, 1)
	out, errOut, code = baseline("first", false)
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "without its dead-letter table "+s.Name+".first_dlq; recorded nothing")
	require.Contains(t, out, "mark no version applied (N = 0)")
	out, errOut, code = baseline("first", true)
	require.Equal(t, 0, code, errOut)
	require.NoError(t, json.Unmarshal([]byte(out), &doc), out)
	require.Equal(t, true, doc["dead_letter_table_missing"])
	require.Equal(t, 0.0, doc["tool_version"])
	require.False(t, tableExists(t, s, "first_dlq"), "a dry run creates nothing")

	// status points tool users to it.
	out, _, code = cliRun(t, nil, "schema", "migrate", "status", "--dsn", s.DSN, "--schema", s.Name, "--table", "first")
	require.Equal(t, 0, code)
	require.Contains(t, out, "baseline --dry-run")
}

func tableExists(t *testing.T, s *pgoutboxtest.Schema, table string) bool {
	t.Helper()
	var ok bool
	require.NoError(t, s.Pool.QueryRow(context.Background(), `SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL`, s.Name, table).Scan(&ok))
	return ok
}

// TestSchemaMigrateLockTimeout: a migration that gives up waiting for a
// table lock says how to allow a longer wait from the command line, and
// that way works: the lock_timeout of PGOPTIONS, or of the DSN's options,
// is the one waited (shorter than the default here, to be quick).
func TestSchemaMigrateLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := pgoutboxtest.NewSchema(t, pgoutboxtest.Options{})
	_, err := schema.Migrate(ctx, tx.FromPgxPool(s.Pool), schema.Config{Schema: s.Name}, 1)
	require.NoError(t, err)
	holder, err := s.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT count(*) FROM "`+s.Name+`".outbox`) // ACCESS SHARE until it ends
	require.NoError(t, err)

	sep := "?"
	if strings.Contains(s.DSN, "?") {
		sep = "&"
	}
	for _, c := range []struct {
		name, dsn, want string
		env             []string
	}{
		{"PGOPTIONS", s.DSN, "lock_timeout (300ms)", []string{"PGOPTIONS=-c lock_timeout=300ms"}},
		{"DSNOptions", s.DSN + sep + "options=-c%20lock_timeout%3D400ms", "lock_timeout (400ms)", nil},
	} {
		start := time.Now()
		_, errOut, code := cliRunEnv(t, c.env, "schema", "migrate", "up", "--dsn", c.dsn, "--schema", s.Name)
		require.Equal(t, exitError, code, c.name)
		require.Less(t, time.Since(start), schema.DDLLockTimeout, "%s: the shorter lock_timeout was the one waited", c.name)
		require.Contains(t, errOut, c.want, c.name)
		require.Contains(t, errOut, "from the command line, run it with PGOPTIONS='-c lock_timeout=30s'", c.name)
		require.Contains(t, errOut, "options=-c%20lock_timeout%3D30s to the --dsn URL", c.name)
		require.Contains(t, errOut, "behind PgBouncer, which refuses options at connect, set it for a role that runs migrations only (ALTER ROLE", c.name)
		require.NotContains(t, errOut, "the server's lock_timeout, a role or database setting", "%s: pgoutbox's own wait, explained once", c.name)
	}
}

// TestSchemaMigrateNewerVersion: an outbox a newer release migrated (a
// deploy rolled back) is named as such by status, and up refuses with
// what to do; both panicked or said nothing before.
func TestSchemaMigrateNewerVersion(t *testing.T) {
	t.Parallel()
	s, run := cliOnNewSchema(t)
	_, errOut, code := run("schema", "migrate", "up")
	require.Equal(t, 0, code, errOut)
	newer := schema.LatestVersion() + 1
	_, err := s.Pool.Exec(context.Background(), `INSERT INTO "`+s.Name+`".outbox_schema_version (version, name) VALUES ($1, 'from a newer release')`, newer)
	require.NoError(t, err)
	out, _, code := run("schema", "migrate", "status")
	require.Equal(t, 0, code)
	require.Contains(t, out, "newer than this release knows")
	for _, args := range [][]string{{"up", "--dry-run"}, {"up"}, {"down", "--to", "5", "--yes"}} {
		out, errOut, code = run(append([]string{"schema", "migrate"}, args...)...)
		require.Equal(t, exitError, code, out)
		require.Contains(t, errOut, "newer than this release")
		require.NotContains(t, errOut, "panic")
	}
}

// TestSchemaApplyOnATableOfYourOwn: apply and baseline refuse a table of
// the service's own under the outbox's name, saying so, without a hint at
// a privilege the role has.
func TestSchemaApplyOnATableOfYourOwn(t *testing.T) {
	t.Parallel()
	s, run := cliOnNewSchema(t)
	_, err := s.Pool.Exec(context.Background(), `CREATE TABLE "`+s.Name+`".outbox (id serial PRIMARY KEY, aggregate text, body jsonb)`)
	require.NoError(t, err)
	for _, args := range [][]string{{"schema", "apply"}, {"schema", "migrate", "baseline"}} {
		out, errOut, code := run(args...)
		require.Equal(t, exitError, code, out)
		require.Contains(t, errOut, "without columns every pgoutbox outbox has", args)
		require.NotContains(t, errOut, "needs CREATE", args)
	}
}

// An outbox that another migrator (goose, golang-migrate) upgraded past the
// version pgoutbox recorded: status said "version 2 of 7" and listed as
// pending what the catalog already had, without a word about it.
func TestSchemaMigrateStatusSaysTheCatalogIsAhead(t *testing.T) {
	t.Parallel()
	s, run := cliOnNewSchema(t)
	_, errOut, code := run("schema", "migrate", "up", "--to", "2", "--yes")
	require.Equal(t, 0, code, errOut)
	sql, errOut, code := run("schema", "migrate", "up", "--dry-run")
	require.Equal(t, 0, code, errOut)
	_, err := s.Pool.Exec(context.Background(), sql) // what the other tool's files run
	require.NoError(t, err)

	out, errOut, code := run("schema", "migrate", "status")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "version 2 of 7\n")
	require.Contains(t, out, "but the tables have the layout of version 7: another tool (goose, golang-migrate) upgraded them since")

	_, errOut, code = run("schema", "migrate", "up")
	require.Equal(t, 0, code, errOut)
	out, _, _ = run("schema", "migrate", "status")
	require.Contains(t, out, "version 7 of 7")
	require.NotContains(t, out, "another tool")
}

// A rotating outbox (converted from a single table at version 6) has the
// catalog of the latest version without having been migrated to it by
// another tool: status says nothing of one. Nor does it fail on a table of
// the name that is no outbox.
func TestSchemaMigrateStatusOfARotatingOutboxOrAnotherTable(t *testing.T) {
	t.Parallel()
	s, run := cliOnNewSchema(t)
	_, errOut, code := run("schema", "migrate", "up", "--to", "6", "--yes")
	require.Equal(t, 0, code, errOut)
	require.NoError(t, schema.ConvertToRotating(context.Background(), tx.FromPgxPool(s.Pool), schema.Config{Schema: s.Name}))
	out, errOut, code := run("schema", "migrate", "status")
	require.Equal(t, 0, code, errOut)
	require.NotContains(t, out, "another tool")

	other, runOther := cliOnNewSchema(t)
	_, err := other.Pool.Exec(context.Background(), `CREATE TABLE "`+other.Name+`".outbox (id int)`)
	require.NoError(t, err)
	out, errOut, code = runOther("schema", "migrate", "status")
	require.Equal(t, 0, code, errOut)
	require.Contains(t, out, "version 0 of 7")
}
