package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const healthExamples = `  pgoutbox health
  pgoutbox health --json | jq '.snapshot_holders[0]'
`

// Warning thresholds of the health lines (docs/operations.md, Vacuum).
const (
	// healthWarnAge: a snapshot held this long keeps every row deleted
	// since, and the claims step over them.
	healthWarnAge = 10 * time.Minute
	// healthWarnXminAge: a quarter of autovacuum_freeze_max_age's default
	// (200 million), for holders whose time is not known.
	healthWarnXminAge = 50_000_000
)

// tableHealthJSON is one table of health --json.
type tableHealthJSON struct {
	Table           string     `json:"table"`
	LiveTuples      int64      `json:"live_tuples"`
	DeadTuples      int64      `json:"dead_tuples"`
	TableBytes      int64      `json:"table_bytes"`
	IndexBytes      int64      `json:"index_bytes"`
	Locked          bool       `json:"locked"` // sizes not read: an exclusive lock was held or awaited
	LastVacuum      *time.Time `json:"last_vacuum"`
	LastAutovacuum  *time.Time `json:"last_autovacuum"`
	LastAnalyze     *time.Time `json:"last_analyze"`
	LastAutoanalyze *time.Time `json:"last_autoanalyze"`
	Autovacuum      bool       `json:"autovacuum"`
}

// holderJSON is one snapshot holder of health --json.
type holderJSON struct {
	Kind            string     `json:"kind"`
	XminAge         int64      `json:"xmin_age"`
	AgeSeconds      *float64   `json:"age_seconds"` // null when unknown
	Since           *time.Time `json:"since"`
	PID             int        `json:"pid,omitempty"`
	User            string     `json:"user,omitempty"`
	ApplicationName string     `json:"application_name,omitempty"`
	BackendType     string     `json:"backend_type,omitempty"`
	State           string     `json:"state,omitempty"`
	Name            string     `json:"name,omitempty"`
	SlotType        string     `json:"slot_type,omitempty"`
	Active          bool       `json:"active,omitempty"`
	CatalogOnly     bool       `json:"catalog_only,omitempty"`
	Database        string     `json:"database,omitempty"`
}

// ringJSON is a rotating outbox's ring in health --json: current is -1
// and current_for_seconds null when the role may not read the sequence.
type ringJSON struct {
	Current           int      `json:"current"`
	CurrentForSeconds *float64 `json:"current_for_seconds"`
	Rows              [3]int64 `json:"rows"`
}

// healthJSON is health --json.
type healthJSON struct {
	Outbox          tableHealthJSON  `json:"outbox"`
	DeadLetters     *tableHealthJSON `json:"dead_letters"`
	Arrivals        *tableHealthJSON `json:"arrivals,omitempty"`
	Ring            *ringJSON        `json:"ring,omitempty"`
	Autovacuum      bool             `json:"autovacuum"`
	TrackCounts     bool             `json:"track_counts"`
	SnapshotHolders []holderJSON     `json:"snapshot_holders"`
}

func (c *cli) healthCmd(args []string) error {
	cmd := c.newCommand("health", "health [--json]", healthExamples, true)
	cmd.inspects = true
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		h, err := pgoutbox.Health(ctx, exec, tables)
		if err != nil {
			return err
		}
		if cmd.json {
			return writeJSON(c.stdout, healthToJSON(h))
		}
		printHealth(c.stdout, h, true)
		return nil
	})
}

func healthToJSON(h pgoutbox.HealthReport) healthJSON {
	out := healthJSON{Outbox: tableToJSON(h.Outbox), Autovacuum: h.Autovacuum, TrackCounts: h.TrackCounts, SnapshotHolders: []holderJSON{}}
	if h.DeadLetters != nil {
		dl := tableToJSON(*h.DeadLetters)
		out.DeadLetters = &dl
	}
	if h.Arrivals != nil {
		a := tableToJSON(*h.Arrivals)
		out.Arrivals = &a
	}
	if r := h.Ring; r != nil {
		out.Ring = &ringJSON{Current: r.Current, Rows: r.Rows}
		if r.Current >= 0 {
			secs := r.CurrentFor.Seconds()
			out.Ring.CurrentForSeconds = &secs
		}
	}
	for _, s := range h.SnapshotHolders {
		j := holderJSON{Kind: string(s.Kind), XminAge: s.XminAge, PID: s.PID, User: s.User, ApplicationName: s.ApplicationName,
			BackendType: s.BackendType, State: s.State, Name: s.Name, SlotType: s.SlotType, Active: s.Active,
			CatalogOnly: s.CatalogOnly, Database: s.Database, Since: timePtr(s.Since)}
		if !s.Since.IsZero() {
			secs := s.Age.Seconds()
			j.AgeSeconds = &secs
		}
		out.SnapshotHolders = append(out.SnapshotHolders, j)
	}
	return out
}

func tableToJSON(t pgoutbox.TableHealth) tableHealthJSON {
	return tableHealthJSON{Table: t.Table, LiveTuples: t.LiveTuples, DeadTuples: t.DeadTuples, TableBytes: t.TableBytes,
		IndexBytes: t.IndexBytes, LastVacuum: timePtr(t.LastVacuum), LastAutovacuum: timePtr(t.LastAutovacuum),
		LastAnalyze: timePtr(t.LastAnalyze), LastAutoanalyze: timePtr(t.LastAutoanalyze), Autovacuum: t.Autovacuum, Locked: t.Locked}
}

// timePtr is nil for the zero time (JSON null: never, or unknown).
func timePtr(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}

// printHealth writes the tables' sizes and dead tuples, the oldest
// snapshot holder (every holder listed when all is set), and warnings
// with what to do.
func printHealth(w io.Writer, h pgoutbox.HealthReport, all bool) {
	tw := newTable(w)
	fmt.Fprintln(tw, "TABLE\tLIVE\tDEAD\tSIZE\tINDEXES\tLAST AUTOVACUUM\tLAST VACUUM\tLAST ANALYZE")
	now := time.Now()
	for _, t := range []*pgoutbox.TableHealth{&h.Outbox, h.DeadLetters, h.Arrivals} {
		if t == nil {
			continue
		}
		size, indexes := bytesHuman(t.TableBytes), bytesHuman(t.IndexBytes)
		if t.Locked {
			size, indexes = "locked", "locked"
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%s\t%s\t%s\t%s\t%s\n", t.Table, t.LiveTuples, t.DeadTuples, size,
			indexes, ago(now, t.LastAutovacuum), ago(now, t.LastVacuum), ago(now, t.LastAnalyzed()))
	}
	tw.Flush()
	if r := h.Ring; r != nil {
		current := "unknown (no SELECT on the generation sequence)"
		if r.Current >= 0 {
			current = fmt.Sprintf("partition %d, for %s", r.Current, age(r.CurrentFor))
		}
		fmt.Fprintf(w, "ring: current %s; rows by partition: %d, %d, %d\n", current, r.Rows[0], r.Rows[1], r.Rows[2])
	}
	if s, ok := h.OldestSnapshot(); ok {
		fmt.Fprintf(w, "oldest snapshot: %s\n", describeHolder(s))
	} else {
		fmt.Fprintln(w, "oldest snapshot: none (no open transaction, slot or prepared transaction holds vacuum back)")
	}
	if all && len(h.SnapshotHolders) > 0 {
		fmt.Fprintln(w)
		tw := newTable(w)
		fmt.Fprintln(tw, "HOLDER\tPID\tNAME\tUSER\tAPPLICATION\tSTATE\tAGE\tXMIN AGE")
		for _, s := range h.SnapshotHolders {
			state := s.State
			if s.Kind == pgoutbox.SnapshotReplicationSlot {
				state = s.SlotType + map[bool]string{true: ", active", false: ", inactive"}[s.Active]
				if s.CatalogOnly {
					state += ", catalogs only"
				}
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\n", s.Kind, dashIfZero(s.PID), dashIfEmpty(s.Name), dashIfEmpty(s.User),
				dashIfEmpty(s.ApplicationName), dashIfEmpty(state), age(s.Age), s.XminAge)
		}
		tw.Flush()
	}
	printHealthWarnings(w, h)
}

// ringWarnAge is how long a ring may keep its current partition before
// health warns: its rows leave a partition nobody empties after three
// windows and at least 30 s, so a minute is past any healthy ring.
const ringWarnAge = time.Minute

// printHealthWarnings says what needs a person, and what to do.
func printHealthWarnings(w io.Writer, h pgoutbox.HealthReport) {
	if !h.Autovacuum {
		fmt.Fprintln(w, "warning: autovacuum is off on this server: nothing removes the outbox's dead rows but a VACUUM someone runs; "+
			"turn it on (autovacuum = on in postgresql.conf, or ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf())")
	}
	if !h.TrackCounts {
		fmt.Fprintln(w, "warning: track_counts is off on this server: the tuple counts stay 0 and autovacuum cannot see which tables need it; turn it on")
	}
	for _, t := range []*pgoutbox.TableHealth{&h.Outbox, h.DeadLetters, h.Arrivals} {
		if t != nil && t.Locked {
			fmt.Fprintf(w, "warning: %s is locked: a session holds or awaits an exclusive lock on it (or a partition, an index of it: "+
				"a VACUUM FULL, an ALTER TABLE, a REINDEX, a migration), and what reads or writes it waits for that, its sizes too; "+
				"the sessions (pid NULL: a prepared transaction, see pg_prepared_xacts): SELECT l.relation::regclass, l.pid, l.granted, "+
				"a.state, a.xact_start, a.query FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid WHERE l.locktype = 'relation' "+
				"AND l.mode = 'AccessExclusiveLock' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())\n", t.Table)
		}
		if t != nil && h.Autovacuum && h.TrackCounts && !t.Autovacuum {
			fmt.Fprintf(w, "warning: autovacuum is disabled for %s; ALTER TABLE %s RESET (autovacuum_enabled)\n", t.Table, quoteQualified(t.Table))
		}
	}
	if r := h.Ring; r != nil && r.Current >= 0 && r.CurrentFor > ringWarnAge {
		next := (r.Current + 1) % len(r.Rows)
		fmt.Fprintf(w, "warning: the ring has not advanced for %s: partition %d (about %d rows) is not emptied; "+
			"a transaction that read the outbox may hold it (see the snapshot holders), or no subscriber runs (the subscribers rotate)\n",
			age(r.CurrentFor), next, r.Rows[next])
	}
	for _, s := range h.SnapshotHolders {
		inactiveSlot := s.Kind == pgoutbox.SnapshotReplicationSlot && !s.Active
		if s.Age < healthWarnAge && s.XminAge < healthWarnXminAge && !inactiveSlot {
			continue
		}
		switch s.Kind {
		case pgoutbox.SnapshotBackend:
			fix := fmt.Sprintf("end it with SELECT pg_terminate_backend(%d), or fix the client (idle_in_transaction_session_timeout ends forgotten transactions)", s.PID)
			if s.BackendType == "walsender" {
				fix = "a replica's hot_standby_feedback: its long queries hold the primary back; end them on the replica, or turn the feedback off there"
			}
			fmt.Fprintf(w, "warning: %s: it holds vacuum back; %s\n", describeHolder(s), fix)
		case pgoutbox.SnapshotReplicationSlot:
			what := "holds the outbox's dead rows"
			if s.CatalogOnly {
				what = "holds back vacuum of the system catalogs and keeps WAL (not the outbox's rows)"
			}
			fmt.Fprintf(w, "warning: %s: it %s; if its consumer is gone, SELECT pg_drop_replication_slot(%s)\n", describeHolder(s), what, sqlString(s.Name))
		case pgoutbox.SnapshotPreparedXact:
			fmt.Fprintf(w, "warning: %s: it holds vacuum back until its transaction manager ends it, or you: COMMIT PREPARED %s or ROLLBACK PREPARED %s\n",
				describeHolder(s), sqlString(s.Name), sqlString(s.Name))
		}
	}
}

// describeHolder is one line about a holder: what, who, for how long.
func describeHolder(s pgoutbox.SnapshotHolder) string {
	var b strings.Builder
	switch s.Kind {
	case pgoutbox.SnapshotBackend:
		fmt.Fprintf(&b, "%s pid %d (user %s", s.BackendType, s.PID, dashIfEmpty(s.User))
		if s.ApplicationName != "" {
			fmt.Fprintf(&b, ", application %q", s.ApplicationName)
		}
		if s.State != "" {
			fmt.Fprintf(&b, ", %s", s.State)
		}
		b.WriteString(")")
	case pgoutbox.SnapshotReplicationSlot:
		active := "inactive"
		if s.Active {
			active = fmt.Sprintf("active, pid %d", s.PID)
		}
		fmt.Fprintf(&b, "replication slot %s (%s, %s)", s.Name, s.SlotType, active)
	case pgoutbox.SnapshotPreparedXact:
		fmt.Fprintf(&b, "prepared transaction %s (owner %s)", s.Name, dashIfEmpty(s.User))
	}
	switch {
	case !s.Since.IsZero():
		fmt.Fprintf(&b, " for %s,", age(s.Age))
	case s.Kind == pgoutbox.SnapshotBackend:
		b.WriteString(" since a time hidden from this role (grant it pg_read_all_stats or pg_monitor to see it),")
	}
	fmt.Fprintf(&b, " %d transactions old", s.XminAge)
	return b.String()
}

// bytesHuman formats a size in kB, MB, GB (powers of 1024, as
// pg_size_pretty).
func bytesHuman(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d bytes", n)
	}
	f, suffix := float64(n)/unit, "kB"
	for _, s := range []string{"MB", "GB", "TB"} {
		if f < unit {
			break
		}
		f, suffix = f/unit, s
	}
	if f < 10 {
		return fmt.Sprintf("%.1f %s", f, suffix)
	}
	return fmt.Sprintf("%.0f %s", f, suffix)
}

// ago formats how long before now t was: "never" for the zero time.
func ago(now, t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return age(max(now.Sub(t), time.Millisecond)) + " ago"
}

func dashIfEmpty(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func dashIfZero(n int) string {
	if n == 0 {
		return "-"
	}
	return fmt.Sprint(n)
}

// quoteQualified quotes "schema.table" (TableHealth.Table, unquoted) for a
// statement to paste: names may hold capitals or dots.
func quoteQualified(table string) string {
	schemaName, name, _ := strings.Cut(table, ".")
	return query.Quote(schemaName) + "." + query.Quote(name)
}

// sqlString is s as an SQL string literal (a slot name, a prepared
// transaction's gid).
func sqlString(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
