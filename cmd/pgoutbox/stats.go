package main

import (
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const statsExamples = `  pgoutbox stats
  pgoutbox stats --topic orders.placed --group billing
  pgoutbox stats --watch --interval 5s
  pgoutbox stats --json | jq '.[] | select(.ready > 1000)'
`

// statsJSON is one row of stats --json.
type statsJSON struct {
	Topic                string           `json:"topic"`
	ConsumerGroup        string           `json:"consumer_group"`
	Bound                bool             `json:"bound"`
	Unbound              int64            `json:"unbound"`
	Ready                int64            `json:"ready"`
	Scheduled            int64            `json:"scheduled"`
	Leased               int64            `json:"leased"`
	ExpiredLeases        int64            `json:"expired_leases"`
	Parked               int64            `json:"parked"`
	OldestReadyAgeSecond float64          `json:"oldest_ready_age_seconds"`
	DeadLetters          map[string]int64 `json:"dead_letters"`
	DeadLettersTotal     int64            `json:"dead_letters_total"`
	Paused               bool             `json:"paused"`
}

func (c *cli) statsCmd(args []string) error {
	cmd := c.newCommand("stats", "stats [--topic T [--group G]] [--watch [--interval 2s]] [--json]", statsExamples, true)
	topic := cmd.fs.String("topic", "", "only this topic")
	var group optString
	cmd.fs.Var(&group, "group", "only this consumer group (\"\" is the default group); needs --topic")
	watch := cmd.fs.Bool("watch", false, "redraw a live table until Ctrl-C")
	interval := cmd.durationVar("interval", 2*time.Second, "refresh `interval` of --watch")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	var opts []pgoutbox.StatsOption
	switch {
	case group.set && *topic == "":
		return usagef(cmd.name, "--group needs --topic (stats are per topic and group)")
	case group.set:
		opts = append(opts, pgoutbox.StatsForGroup(*topic, group.value))
	case *topic != "":
		opts = append(opts, pgoutbox.StatsForTopic(*topic))
	}
	if *watch && cmd.json {
		return usagef(cmd.name, "--watch and --json do not go together; poll \"stats --json\" from your script instead")
	}
	if cmd.given("interval") && !*watch {
		return usagef(cmd.name, "--interval sets how often --watch redraws; add --watch, or leave --interval out")
	}
	if *interval < 100*time.Millisecond {
		return usagef(cmd.name, "--interval %s is too short; use 100ms or more", *interval)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cmd.inspects = !*watch // a watch bounds each redraw
	return cmd.withOutbox(ctx, nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		if !*watch {
			stats, err := pgoutbox.Stats(ctx, exec, tables, opts...)
			if err != nil {
				return err
			}
			if cmd.json {
				return writeJSON(c.stdout, statsToJSON(stats))
			}
			printStats(c.stdout, stats)
			printStatsHealth(ctx, c.stdout, exec, tables)
			return nil
		}
		tick := time.NewTicker(*interval)
		defer tick.Stop()
		first := true
		for {
			rctx, cancel := reading(ctx)
			stats, err := pgoutbox.Stats(rctx, exec, tables, opts...)
			err = readTimedOut(rctx, err)
			if ctx.Err() != nil {
				cancel()
				return nil // Ctrl-C
			}
			if stdoutIsTerminal(c.stdout) {
				// Clear the screen and home the cursor, then draw.
				fmt.Fprint(c.stdout, "\033[H\033[2J")
			} else if !first {
				fmt.Fprintln(c.stdout) // a pipe or file gets the tables one after another
			}
			first = false
			fmt.Fprintf(c.stdout, "pgoutbox stats  %s  every %s  (Ctrl-C to stop)\n\n", time.Now().Format("15:04:05"), *interval)
			if err != nil {
				fmt.Fprintf(c.stdout, "error: %v%s (retrying)\n", err, hint(err))
			} else {
				printStats(c.stdout, stats)
				printStatsHealth(rctx, c.stdout, exec, tables)
			}
			cancel()
			select {
			case <-ctx.Done():
				return nil
			case <-tick.C:
			}
		}
	})
}

// printStatsHealth prints the table lines under the queues; when Health
// fails (a role without a grant it needs), a warning says so and the
// queues stay printed.
func printStatsHealth(ctx context.Context, w io.Writer, exec tx.Executor, tables schema.Config) {
	fmt.Fprintln(w)
	health, err := pgoutbox.Health(ctx, exec, tables)
	if err != nil {
		fmt.Fprintf(w, "warning: table health not shown: %v\n", err)
		return
	}
	printHealth(w, health, false)
}

func statsToJSON(stats []pgoutbox.QueueStats) []statsJSON {
	out := make([]statsJSON, 0, len(stats))
	for _, s := range stats {
		j := statsJSON{
			Topic: s.Topic, ConsumerGroup: s.ConsumerGroup, Bound: s.Bound, Unbound: s.Unbound(), Ready: s.Ready, Scheduled: s.Scheduled,
			Leased: s.Leased, ExpiredLeases: s.ExpiredLeases, Parked: s.Parked,
			OldestReadyAgeSecond: s.OldestReadyAge.Seconds(), DeadLetters: s.DeadLetters, Paused: s.Paused,
		}
		if j.DeadLetters == nil {
			j.DeadLetters = map[string]int64{}
		}
		for _, n := range j.DeadLetters {
			j.DeadLettersTotal += n
		}
		out = append(out, j)
	}
	return out
}

func printStats(w io.Writer, stats []pgoutbox.QueueStats) {
	if len(stats) == 0 {
		fmt.Fprintln(w, "no messages and no bound groups")
		return
	}
	tw := newTable(w)
	fmt.Fprintln(tw, "TOPIC\tGROUP\tREADY\tSCHEDULED\tLEASED\tEXPIRED\tPARKED\tOLDEST READY\tDEAD LETTERS\tSTATE")
	for _, s := range stats {
		dl := "-"
		if len(s.DeadLetters) > 0 {
			var parts []string
			for _, r := range slices.Sorted(maps.Keys(s.DeadLetters)) {
				parts = append(parts, fmt.Sprintf("%s=%d", r, s.DeadLetters[r]))
			}
			dl = strings.Join(parts, " ")
		}
		// As the operator page says it: a group that is not bound is
		// consumed by nobody, whatever its rows. "bound", not "running":
		// whether a subscriber runs is not in the table.
		state := "bound"
		switch {
		case s.Paused:
			state = "PAUSED"
		case !s.Bound:
			state = "not bound"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\n", plainOrQuoted(s.Topic), groupName(s.ConsumerGroup),
			s.Ready, s.Scheduled, s.Leased, s.ExpiredLeases, s.Parked, age(s.OldestReadyAge), dl, state)
	}
	tw.Flush()
	printUnboundWarnings(w, stats)
}

// printUnboundWarnings says, under the table, which groups hold messages
// no bound group will consume, and what to do.
func printUnboundWarnings(w io.Writer, stats []pgoutbox.QueueStats) {
	bound := map[string]bool{} // topics with a binding
	for _, s := range stats {
		if s.Bound {
			bound[s.Topic] = true
		}
	}
	for _, s := range stats {
		n := s.Unbound()
		switch {
		case n == 0:
		case s.ConsumerGroup == "" && !bound[s.Topic]:
			fmt.Fprintf(w, "warning: %d message(s) of topic %q were published while nothing was bound to it; "+
				"the first group to bind it gets them (Subscribe, or pgoutbox bind --topic %s --group G)\n", n, s.Topic, shellArg(s.Topic))
		case s.ConsumerGroup == "":
			fmt.Fprintf(w, "warning: %d message(s) of topic %q wait in the default group, which is not bound; "+
				"the next bind of the topic hands them to its groups, or pgoutbox move --topic %s --from '' --to G\n", n, s.Topic, shellArg(s.Topic))
		default:
			fmt.Fprintf(w, "warning: group %s is not bound to topic %q and holds %d message(s) nobody will consume until it is; "+
				"pgoutbox bind --topic %s --group %s (or a Subscribe of the group) if it is to consume them, "+
				"pgoutbox move --topic %s --from %s --to G to hand them to another (a group that does not have them yet: one that had its own copies would get them twice), "+
				"or unbind --purge\n", groupName(s.ConsumerGroup), s.Topic, n, shellArg(s.Topic), shellArg(s.ConsumerGroup), shellArg(s.Topic), shellArg(s.ConsumerGroup))
		}
	}
}
