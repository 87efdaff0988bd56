package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/errtext"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const migrateUsage = `Usage:
  pgoutbox schema migrate up [--to N] [--dry-run]     apply the pending migrations (to the latest, or N)
  pgoutbox schema migrate down [--to N] [--dry-run]   undo the last migration (or down to N; 0 drops the tables)
  pgoutbox schema migrate status [--json]             the recorded version and what is pending
  pgoutbox schema migrate baseline [--dry-run]        record the version of an outbox made before versions were recorded
                                                      (--dry-run: print it, record nothing; for goose and golang-migrate)
  pgoutbox schema migrate files --format F --out DIR  write the migrations for goose or golang-migrate (and atlas)

Run "pgoutbox schema migrate <command> --help" for flags.
`

func (c *cli) migrateCmd(args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.stderr, migrateUsage)
		return usagef("schema migrate", "missing subcommand: up, down, status, baseline or files")
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(c.stdout, migrateUsage+"\n"+exitCodesHelp)
		return errHelp
	case "up":
		return c.migrateUpDown(args[1:], false)
	case "down":
		return c.migrateUpDown(args[1:], true)
	case "status":
		return c.migrateStatus(args[1:])
	case "baseline":
		return c.migrateBaseline(args[1:])
	case "files":
		return c.migrateFiles(args[1:])
	}
	return usagef("schema migrate", "unknown subcommand %q; use up, down, status, baseline or files", args[0])
}

func (c *cli) migrateUpDown(args []string, down bool) error {
	name := "schema migrate up"
	usage := "schema migrate up [--to N] [--dry-run] [--yes] [connection flags]"
	examples := "  pgoutbox schema migrate up\n  pgoutbox schema migrate up --to 3 --dry-run\n"
	if down {
		name = "schema migrate down"
		usage = "schema migrate down [--to N] [--dry-run] [--yes] [connection flags]"
		examples = "  pgoutbox schema migrate down --dry-run\n  pgoutbox schema migrate down --to 3 --yes\n"
	}
	cmd := c.newCommand(name, usage, examples, false)
	toHelp := "the version to reach (when not given: the latest)"
	if down {
		toHelp = "the version to reach (when not given: one below the current); 0 drops the outbox's tables"
	}
	toFlag := cmd.fs.String("to", "", toHelp)
	dryRun := cmd.fs.Bool("dry-run", false, "print the SQL it would run, and run nothing")
	var dropMessages *bool
	// Up never asks; it takes --yes all the same, so that a deploy script
	// can pass it to every schema command.
	yesHelp := "accepted and ignored: up does not ask"
	if down {
		yesHelp = "do not ask for confirmation"
		dropMessages = cmd.fs.Bool("drop-messages", false, "with --to 0: drop the tables even though they hold messages or dead letters")
	}
	yes := cmd.fs.Bool("yes", false, yesHelp)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	latest := schema.LatestVersion()
	to := -1
	if cmd.given("to") {
		n, err := strconv.Atoi(*toFlag)
		if err != nil {
			return usagef(name, "--to %q is not a version number; use 0 to %d", *toFlag, latest)
		}
		if n < 0 || n > latest {
			return usagef(name, "--to %s is out of range; use 0 to %d", *toFlag, latest)
		}
		to = n
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, t schema.Config) error {
		st, err := schema.MigrationStatus(ctx, exec, t)
		if err != nil {
			return err
		}
		target := to
		switch {
		case target == -1 && down && st.Current == 1:
			return usagef(name, "version 1 is the first; undoing it drops the outbox's tables and every message in them: give --to 0 for that")
		case target == -1 && down:
			target = max(st.Current-1, 0)
		case target == -1:
			target = latest
		case down && target > st.Current:
			return usagef(name, "--to %d is above the current version %d; use \"schema migrate up\"", target, st.Current)
		case !down && target < st.Current:
			return usagef(name, "--to %d is below the current version %d; use \"schema migrate down\"", target, st.Current)
		}
		libTarget := target // the library refuses 0, so that a zero value never drops an outbox
		if target == 0 {
			libTarget = schema.NoTables
		}
		plan, err := schema.MigrationPlan(ctx, exec, t, libTarget)
		if err != nil {
			return err
		}
		if len(plan) == 0 {
			fmt.Fprintf(c.stdout, "nothing to do: %s is at version %d\n", tablesName(t), st.Current)
			if !down && st.Current == st.Latest {
				printCatalogProblems(c.stdout, catalogProblems(ctx, exec, t))
			}
			return nil
		}
		if *dryRun {
			for _, s := range plan {
				fmt.Fprintf(c.stdout, "-- %s version %d (%s)\n", stepVerb(s), s.Version, s.Name)
				for _, stmt := range s.Statements {
					fmt.Fprintf(c.stdout, "%s;\n\n", stmt)
				}
			}
			return nil
		}
		if down && target == 0 && !*dropMessages {
			// --yes answers the question, not this: a script's `down
			// --to 0 --yes` must not delete what the tables still hold.
			held, err := tableHoldingRows(ctx, exec, t)
			if err != nil {
				return err
			}
			if held != "" {
				return &refusedError{msg: fmt.Sprintf("%s holds rows; dropping it would delete them: move or drain them first, or add --drop-messages to drop them with the tables", held)}
			}
		}
		if down {
			q := fmt.Sprintf("Migrate %s down from version %d to %d?", tablesName(t), st.Current, target)
			if target == 0 {
				q = fmt.Sprintf("Migrate %s down to version 0, dropping its tables and every message in them?", tablesName(t))
			}
			if err := c.confirm(name, q, *yes); err != nil {
				return err
			}
		}
		steps, err := schema.Migrate(ctx, exec, t, libTarget)
		for _, s := range steps {
			fmt.Fprintf(c.stdout, "%s version %d (%s)\n", stepPast(s), s.Version, s.Name)
		}
		if err != nil {
			return lockWaitHint(err)
		}
		if len(steps) == 0 {
			fmt.Fprintf(c.stdout, "nothing to do: another migration got there first\n")
		}
		return nil
	})
}

func stepVerb(s schema.MigrationStep) string {
	if s.Down {
		return "undo"
	}
	return "apply"
}

func stepPast(s schema.MigrationStep) string {
	if s.Down {
		return "undid"
	}
	return "applied"
}

func tablesName(t schema.Config) string {
	t = t.WithDefaults()
	return t.Schema + "." + t.Table
}

func (c *cli) migrateStatus(args []string) error {
	cmd := c.newCommand("schema migrate status", "schema migrate status [--json] [connection flags]",
		"  pgoutbox schema migrate status\n  pgoutbox schema migrate status --json\n", true)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, t schema.Config) error {
		st, err := schema.MigrationStatus(ctx, exec, t)
		if err != nil {
			return err
		}
		needsBaseline := st.Current == 0 && st.OutboxExists
		var problems []string
		if st.Current == st.Latest {
			problems = catalogProblems(ctx, exec, t)
		}
		// Without a recorded version (an outbox made by Create, an earlier
		// release, or goose or golang-migrate, which record versions in
		// their own tables), the catalog tells which version's layout it has.
		var layout *schema.BaselineLayout
		if needsBaseline {
			if l, err := schema.BaselinePlan(ctx, exec, t); err == nil {
				layout = &l
			}
		}
		// A catalog ahead of the recorded version: another migrator (goose,
		// golang-migrate) upgraded the outbox since pgoutbox's recorded one.
		ahead := 0
		if st.Current > 0 && st.LayoutVersion > st.Current {
			ahead = st.LayoutVersion
		}
		if cmd.json {
			type applied struct {
				Version   int       `json:"version"`
				Name      string    `json:"name"`
				AppliedAt time.Time `json:"applied_at"`
			}
			type pending struct {
				Version int    `json:"version"`
				Name    string `json:"name"`
			}
			doc := struct {
				Current       int       `json:"current"`
				Latest        int       `json:"latest"`
				NeedsBaseline bool      `json:"needs_baseline"`
				LayoutVersion *int      `json:"layout_version,omitempty"`
				Applied       []applied `json:"applied"`
				Pending       []pending `json:"pending"`
				// What the catalog lacks or holds beyond the recorded version
				// (schema.Validate), at the latest version only.
				CatalogProblems []string `json:"catalog_problems"`
			}{Current: st.Current, Latest: st.Latest, NeedsBaseline: needsBaseline, Applied: []applied{}, Pending: []pending{}, CatalogProblems: problems}
			if doc.CatalogProblems == nil {
				doc.CatalogProblems = []string{}
			}
			if layout != nil {
				doc.LayoutVersion = &layout.Version
			} else if ahead > 0 {
				doc.LayoutVersion = &ahead // the catalog is ahead of Current
			}
			for _, a := range st.Applied {
				doc.Applied = append(doc.Applied, applied{a.Version, a.Name, a.AppliedAt})
			}
			for _, p := range st.Pending {
				if layout != nil && p.Version <= layout.Version && !layout.DeadLetterTableMissing {
					continue // the catalog has it, though no version is recorded
				}
				doc.Pending = append(doc.Pending, pending{p.Version, p.Name})
			}
			return writeJSON(c.stdout, doc)
		}
		if layout != nil {
			printUnrecordedLayout(c.stdout, tablesName(t), *layout, st)
			return nil
		}
		fmt.Fprintf(c.stdout, "%s: version %d of %d\n", tablesName(t), st.Current, st.Latest)
		if st.Current == st.Latest {
			printCatalogProblems(c.stdout, problems)
		}
		if st.Current > st.Latest {
			fmt.Fprintf(c.stdout, "version %d is newer than this release knows (up to %d): a newer release migrated the outbox; migrate it with that release's pgoutbox\n", st.Current, st.Latest)
		}
		for _, a := range st.Applied {
			fmt.Fprintf(c.stdout, "  applied  %4d %-24s %s\n", a.Version, a.Name, listTime(a.AppliedAt))
		}
		for _, p := range st.Pending {
			fmt.Fprintf(c.stdout, "  pending  %4d %s\n", p.Version, p.Name)
		}
		if ahead > 0 {
			fmt.Fprintf(c.stdout, "but the tables have the layout of version %d: another tool (goose, golang-migrate) upgraded them since; use one migrator for an outbox,"+
				" and read that tool's status (pgoutbox's \"up\" would apply versions %d to %d again, which changes nothing)\n", ahead, st.Current+1, ahead)
		}
		if st.Current == 0 && !st.OutboxExists {
			fmt.Fprintf(c.stdout, "there is no table %s yet: \"pgoutbox schema migrate up\" creates the outbox; if it exists under other names, pass its --schema and --table\n", tablesName(t))
		}
		if needsBaseline {
			fmt.Fprintln(c.stdout, `the tables exist but no version is recorded: run "pgoutbox schema migrate baseline" first`+
				` (with goose or golang-migrate, "pgoutbox schema migrate baseline --dry-run" prints the version to mark applied in their table, recording nothing)`)
		}
		return nil
	})
}

// catalogProblems is what schema.Validate finds wrong with an outbox whose
// recorded version is the latest: a process of an earlier release that runs
// its schema.Create at start puts back what a migration replaced (the
// first release's dedup index), which the recorded version cannot show.
// Nothing when Validate cannot read the catalog: status reports versions.
func catalogProblems(ctx context.Context, exec tx.Executor, t schema.Config) []string {
	var verr *schema.ValidationError
	if errors.As(schema.Validate(ctx, exec, t), &verr) {
		return verr.Problems
	}
	return nil
}

func printCatalogProblems(w io.Writer, problems []string) {
	if len(problems) == 0 {
		return
	}
	fmt.Fprintf(w, "but the catalog differs from that version: %s\n", strings.Join(problems, "; "))
	fmt.Fprintln(w, `  "pgoutbox schema apply", with the names and flags the deployment uses (--no-dlq for an outbox without a dead-letter table), repairs it;`+
		` a process of an earlier release that runs schema.Create at start puts an old index back: upgrade it, or keep it from running Create`)
}

// printUnrecordedLayout is the status of an outbox whose version pgoutbox's
// table does not record: made by Create or an earlier release, or managed
// by goose or golang-migrate, which record versions in their own tables.
// Its catalog tells which version's layout it has.
func printUnrecordedLayout(w io.Writer, name string, l schema.BaselineLayout, st schema.MigrationState) {
	if l.Version == st.Latest && !l.DeadLetterTableMissing {
		fmt.Fprintf(w, "%s: no version recorded by pgoutbox; the tables have the layout of version %d: up to date\n", name, l.Version)
	} else {
		fmt.Fprintf(w, "%s: no version recorded by pgoutbox; the tables have the layout of version %d of %d\n", name, l.Version, st.Latest)
		for _, p := range st.Pending {
			if p.Version > l.Version || l.DeadLetterTableMissing {
				fmt.Fprintf(w, "  pending  %4d %s\n", p.Version, p.Name)
			}
		}
	}
	fmt.Fprintln(w, `  goose or golang-migrate keep versions in their own table: if one manages this outbox, its status is the one to read ("goose status", "migrate version") and its "up" upgrades;`+
		` "pgoutbox schema migrate baseline --dry-run" prints the version to mark applied there if it has none`)
	fmt.Fprintln(w, `  otherwise "pgoutbox schema migrate baseline" records the layout's version here, then "pgoutbox schema migrate up" upgrades`)
}

func (c *cli) migrateBaseline(args []string) error {
	cmd := c.newCommand("schema migrate baseline", "schema migrate baseline [--dry-run] [--json] [connection flags]",
		"  pgoutbox schema migrate baseline && pgoutbox schema migrate up\n"+
			"  pgoutbox schema migrate baseline --dry-run   (goose, golang-migrate: the version to mark applied)\n", true)
	dryRun := cmd.fs.Bool("dry-run", false, "print the version it would record, and what goose or golang-migrate should mark applied; record and create nothing")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, t schema.Config) error {
		if *dryRun {
			return c.baselineDryRun(ctx, exec, t, cmd.json)
		}
		v, err := schema.Baseline(ctx, exec, t)
		if err != nil {
			return lockWaitHint(err)
		}
		if cmd.json {
			return writeJSON(c.stdout, struct {
				Version  int  `json:"version"`
				Latest   int  `json:"latest"`
				Recorded bool `json:"recorded"`
			}{v, schema.LatestVersion(), true})
		}
		fmt.Fprintf(c.stdout, "recorded version %d for %s (of %d); \"pgoutbox schema migrate up\" applies the rest\n", v, tablesName(t), schema.LatestVersion())
		return nil
	})
}

// baselineDryRun prints what baseline would record, and the version a
// migration tool with its own version table marks applied instead:
// recording it in pgoutbox's table would leave that table behind the
// tool's, and Create would not take over from it.
func (c *cli) baselineDryRun(ctx context.Context, exec tx.Executor, t schema.Config, asJSON bool) error {
	l, err := schema.BaselinePlan(ctx, exec, t)
	if err != nil {
		return err
	}
	latest := schema.LatestVersion()
	if asJSON {
		return writeJSON(c.stdout, struct {
			Version                int  `json:"version"`
			Latest                 int  `json:"latest"`
			Recorded               bool `json:"recorded"`
			DeadLetterTableMissing bool `json:"dead_letter_table_missing"`
			ToolVersion            int  `json:"tool_version"`
		}{l.Version, latest, false, l.DeadLetterTableMissing, l.ToolVersion()})
	}
	t = t.WithDefaults()
	if l.DeadLetterTableMissing {
		fmt.Fprintf(c.stdout, "%s has the layout of version %d (of %d), without its dead-letter table %s.%s; recorded nothing\n", tablesName(t), l.Version, latest, t.Schema, t.DeadLetterTable)
		fmt.Fprintf(c.stdout, "  pgoutbox's migrator: \"pgoutbox schema migrate baseline\" records version %d and creates the dead-letter table; then \"pgoutbox schema migrate up\"\n", l.Version)
		fmt.Fprintf(c.stdout, "  goose or golang-migrate: mark no version applied (N = 0), then up: version 1 runs again and creates the dead-letter table, which version 3 alters\n")
		fmt.Fprintf(c.stdout, "  (to keep running without one, render the files with --no-dlq, set NoDeadLetterTable, and mark version 1)\n")
		return nil
	}
	fmt.Fprintf(c.stdout, "%s has the layout of version %d (of %d); recorded nothing\n", tablesName(t), l.Version, latest)
	fmt.Fprintf(c.stdout, "  pgoutbox's migrator: \"pgoutbox schema migrate baseline\" records it; then \"pgoutbox schema migrate up\"\n")
	fmt.Fprintf(c.stdout, "  goose or golang-migrate: mark versions 1 to %d applied (N = %d), then up\n", l.ToolVersion(), l.ToolVersion())
	return nil
}

// lockWaitHint adds to a schema change that gave up waiting for a table
// lock how to allow a longer wait from the command line: the library's
// advice names the session's lock_timeout, which pgoutbox takes from the
// connection's options (inLockedTx keeps a lock_timeout the session set).
func lockWaitHint(err error) error {
	if errtext.SQLState(err) != "55P03" { // lock_not_available
		return err
	}
	return &hintedError{err: err, hint: "\nto allow a longer wait from the command line, run it with PGOPTIONS='-c lock_timeout=30s' in the environment, or add options=-c%20lock_timeout%3D30s to the --dsn URL (options='-c lock_timeout=30s' in a key=value DSN); behind PgBouncer, which refuses options at connect, set it for a role that runs migrations only (ALTER ROLE <role> SET lock_timeout = '30s'; on the application's role it would bound its transactions' lock waits too: ALTER ROLE <role> RESET lock_timeout after)"}
}

func (c *cli) migrateFiles(args []string) error {
	cmd := c.newCommand("schema migrate files", "schema migrate files --format goose|golang-migrate --out DIR [--schema S] [--table T] [--dlq-table D | --no-dlq]",
		"  pgoutbox schema migrate files --format goose --out db/migrations\n  pgoutbox schema migrate files --format golang-migrate --out migrations --schema app\n", false)
	format := cmd.fs.String("format", "", "goose, or golang-migrate (which atlas reads too)")
	out := cmd.fs.String("out", "", "the directory to write to (created when missing; existing files are not overwritten)")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("format", *format); err != nil {
		return err
	}
	if err := cmd.required("out", *out); err != nil {
		return err
	}
	f, err := schema.ParseMigrationFormat(*format)
	if err != nil {
		return usagef(cmd.name, "%s", strings.TrimPrefix(err.Error(), "pgoutbox: "))
	}
	t, err := cmd.tables()
	if err != nil {
		return err
	}
	fsys, err := schema.Migrations(t, f)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return fmt.Errorf("write migrations: %w", err)
	}
	entries, err := fs.ReadDir(fsys, ".")
	if err != nil {
		return err
	}
	// Every file is checked before any is written, so a refusal leaves
	// the directory as it was.
	var write []fs.DirEntry
	for _, e := range entries {
		data, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return err
		}
		path := filepath.Join(*out, e.Name())
		existing, err := os.ReadFile(path)
		switch {
		case errors.Is(err, fs.ErrNotExist):
			write = append(write, e)
		case err != nil:
			return fmt.Errorf("write migrations: %w", err)
		case string(existing) == string(data):
			// The same file, from an earlier run.
		case earlierRendering(t, string(existing), string(data)):
			// The same migration as an earlier release wrote it: kept,
			// since a migration already applied must not change.
			fmt.Fprintf(c.stdout, "%s kept: an earlier rendering of the same migration\n", path)
		default:
			return filesConflict(path, string(existing), string(data))
		}
	}
	for _, e := range write {
		data, err := fs.ReadFile(fsys, e.Name())
		if err != nil {
			return err
		}
		path := filepath.Join(*out, e.Name())
		file, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return fmt.Errorf("write migrations: %w", err)
		}
		_, werr := file.Write(data)
		if cerr := file.Close(); werr == nil {
			werr = cerr
		}
		if werr != nil {
			return fmt.Errorf("write migrations: %w", werr)
		}
		fmt.Fprintln(c.stdout, path)
	}
	return nil
}

// earlierRendering reports whether existing is rendered, as an earlier
// release did, the migration that rendered is now: version 1 created a
// schema other than public with a bare CREATE SCHEMA IF NOT EXISTS before
// it checked whether the schema exists (query.CreateSchema). The two do
// the same where the migration role may create schemas, which the earlier
// one needed to have run.
func earlierRendering(t schema.Config, existing, rendered string) bool {
	t = t.WithDefaults()
	n, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil || n.Schema == "public" {
		return false
	}
	guarded := query.CreateSchema(n)
	return strings.Contains(rendered, guarded) &&
		existing == strings.Replace(rendered, guarded, "CREATE SCHEMA IF NOT EXISTS "+n.QSchema, 1)
}

// qualifiedNameRE matches a quoted, schema-qualified name, as the files
// write the outbox's tables: "schema"."table".
var qualifiedNameRE = regexp.MustCompile(`"(?:[^"]|"")+"\."(?:[^"]|"")+"`)

// filesConflict explains an existing file that differs from the one
// rendered: a file of another outbox (its tables have other names, or
// another dead-letter setting), or a file changed since it was written.
func filesConflict(path, existing, rendered string) error {
	have, want := qualifiedNames(existing), qualifiedNames(rendered)
	var other, ours []string
	for name := range have {
		if !want[name] {
			other = append(other, name)
		}
	}
	for name := range want {
		if !have[name] {
			ours = append(ours, name)
		}
	}
	if len(other)+len(ours) == 0 {
		return fmt.Errorf("write migrations: %s exists with other content; a migration already applied must not change: write the new versions to an empty directory and copy them over", path)
	}
	slices.Sort(other)
	slices.Sort(ours)
	var diff []string
	if len(other) > 0 {
		diff = append(diff, "it names "+strings.Join(other, ", "))
	}
	if len(ours) > 0 {
		diff = append(diff, "these files name "+strings.Join(ours, ", "))
	}
	return fmt.Errorf("write migrations: %s was rendered for another outbox (%s): give each outbox's files a directory of their own (and the tool a version table of its own, docs/upgrading.md), or, if it is this outbox's, pass the names it was rendered for (--schema, --table, --dlq-table or --no-dlq)",
		path, strings.Join(diff, "; "))
}

func qualifiedNames(text string) map[string]bool {
	names := map[string]bool{}
	for _, m := range qualifiedNameRE.FindAllString(text, -1) {
		names[m] = true
	}
	return names
}

// tableHoldingRows names the first of the outbox's message tables (the
// outbox, its dead letters, its arrivals) that exists and holds a row, or
// returns "".
func tableHoldingRows(ctx context.Context, exec tx.Executor, t schema.Config) (string, error) {
	t = t.WithDefaults()
	n, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil {
		return "", err
	}
	for _, table := range []string{n.QTable, n.QDLQ, n.WithArrivals().QArrivals} {
		if table == "" {
			continue
		}
		var exists bool
		if err := queryValue(ctx, exec, &exists, `SELECT to_regclass($1) IS NOT NULL`, table); err != nil {
			return "", err
		}
		if !exists {
			continue
		}
		var rows bool
		if err := queryValue(ctx, exec, &rows, `SELECT EXISTS (SELECT 1 FROM `+table+`)`); err != nil {
			return "", err
		}
		if rows {
			return table, nil
		}
	}
	return "", nil
}
