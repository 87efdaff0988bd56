package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// topicGroupFlags adds the --topic and --group flags of bind and unbind.
func topicGroupFlags(cmd *command) (topic, group *string) {
	topic = cmd.fs.String("topic", "", "the topic (required)")
	group = cmd.fs.String("group", "", "the consumer group (\"\" is the default group)")
	return topic, group
}

func (c *cli) bindCmd(args []string) error {
	cmd := c.newCommand("bind", "bind --topic T [--group G] [--from new|backlog]   (no --group: the default group)",
		"  pgoutbox bind --topic orders.placed --group billing                  # before the first deploy of billing\n"+
			"  pgoutbox bind --topic orders.placed --group projection --from backlog # also copy what waits now\n", false)
	topic, group := topicGroupFlags(cmd)
	from := cmd.fs.String("from", string(pgoutbox.StartFromNew), "where a new group starts: \"new\" (messages published from now on) or \"backlog\" (also a copy of the topic's current backlog)")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	start := pgoutbox.StartFrom(*from)
	if start != pgoutbox.StartFromNew && start != pgoutbox.StartFromBacklog {
		return usagef(cmd.name, "--from %q: use new or backlog", *from)
	}
	g := groupName(*group)
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		// Stats reads the topic's groups, dead letters and pauses: its
		// "stats:" would not say that bind failed, nor that nothing was bound.
		before, err := pgoutbox.Stats(ctx, exec, tables, pgoutbox.StatsForTopic(*topic))
		if err != nil {
			return doing(fmt.Sprintf("bind group %s to topic %q: read the topic's queues first (nothing was bound)", g, *topic), err, "stats: ")
		}
		res, err := pgoutbox.BindGroups(ctx, exec, tables, *topic, []string{*group}, pgoutbox.BindStartFrom(start))
		if err != nil {
			return err
		}
		// The default group, bound at last, keeps what waited in it unbound.
		var stay int64
		for _, s := range before {
			if *group == "" && s.ConsumerGroup == "" && !s.Bound && s.Unbound() > 0 {
				stay = s.Unbound()
			}
		}
		if len(res.New) == 0 {
			fmt.Fprintf(c.stdout, "group %s was bound to topic %q already: it gets every message published to it\n", g, *topic)
		} else if res.Copied > 0 || res.Adopted > 0 || stay > 0 {
			fmt.Fprintf(c.stdout, "bound group %s to topic %q: it gets every message published from now on, and the earlier ones counted below\n", g, *topic)
		} else {
			fmt.Fprintf(c.stdout, "bound group %s to topic %q: it gets every message published from now on\n", g, *topic)
		}
		if res.Copied > 0 {
			fmt.Fprintf(c.stdout, "copied the topic's backlog for group %s: %d message(s)\n", g, res.Copied)
		}
		if res.Adopted > 0 {
			fmt.Fprintf(c.stdout, "%d message(s) published while nothing consumed the topic went to the groups bound now\n", res.Adopted)
		}
		printStillPublishing(c.stdout, *topic, res.StillPublishing)
		if stay > 0 {
			fmt.Fprintf(c.stdout, "%d message(s) published while nothing was bound stay in the default group, which is bound now\n", stay)
		}
		after, err := pgoutbox.Stats(ctx, exec, tables, pgoutbox.StatsForTopic(*topic))
		if err != nil {
			return doing(fmt.Sprintf("group %s is bound to topic %q, but reading the topic's queues for messages left in unbound groups failed", g, *topic), err, "stats: ")
		}
		printUnboundWarnings(c.stdout, after)
		return nil
	})
}

func (c *cli) moveCmd(args []string) error {
	cmd := c.newCommand("move", "move --topic T --from G1 --to G2 [--yes]",
		"  pgoutbox move --topic orders.placed --from old-billing --to billing --yes\n"+
			"  pgoutbox move --topic orders.placed --from \"\" --to billing   # messages published before billing's binding\n", false)
	topic := cmd.fs.String("topic", "", "the topic (required)")
	from := cmd.fs.String("from", "", "the group whose waiting messages move (\"\" is the default group)")
	to := cmd.fs.String("to", "", "the group they move to (\"\" is the default group); not one that has its own copies of them (a group bound beside G1): it would get them twice")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	if *from == *to {
		return usagef(cmd.name, "--from and --to name the same group %s; name two different groups", groupName(*from))
	}
	confirm := func() error {
		return c.confirm(cmd.name, fmt.Sprintf("Move the waiting messages of group %s of %q into group %s?", groupName(*from), *topic, groupName(*to)), *yes)
	}
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		n, err := pgoutbox.MoveGroup(ctx, exec, tables, *topic, *from, *to)
		if err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "moved %d message(s) of topic %q from group %s to group %s\n", n, *topic, groupName(*from), groupName(*to))
		st, err := pgoutbox.Stats(ctx, exec, tables, pgoutbox.StatsForGroup(*topic, *to))
		if err != nil {
			return doing(fmt.Sprintf("the messages moved, but checking that group %s is bound to topic %q failed", groupName(*to), *topic), err, "stats: ")
		}
		if len(st) == 1 && !st[0].Bound {
			fmt.Fprintf(c.stdout, "warning: group %s is not bound to %q: the moved messages wait for it, but it gets no copy of what is published until it is bound; "+
				"bind it (pgoutbox bind --topic %s --group %s), or start its subscribers, whose Subscribe binds it\n",
				groupName(*to), *topic, shellArg(*topic), shellArg(*to))
		}
		return nil
	})
}

func (c *cli) renameCmd(args []string) error {
	cmd := c.newCommand("rename", "rename --topic T --from G1 --to G2 [--yes]",
		"  pgoutbox rename --topic orders.placed --from billing --to invoicing --yes\n", false)
	topic := cmd.fs.String("topic", "", "the topic (required)")
	from := cmd.fs.String("from", "", "the group's name now (required)")
	to := cmd.fs.String("to", "", "its new name (required)")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	given := false
	cmd.fs.Visit(func(f *flag.Flag) { given = given || f.Name == "from" })
	if given && *from == "" {
		return usagef(cmd.name, "the default group cannot be renamed: bind the new group, move the default group's messages (pgoutbox move --from '' --to G), then unbind it")
	}
	for _, f := range []struct{ name, value string }{{"topic", *topic}, {"from", *from}, {"to", *to}} {
		if err := cmd.required(f.name, f.value); err != nil {
			return err
		}
	}
	confirm := func() error {
		return c.confirm(cmd.name, fmt.Sprintf("Rename group %s of %q to %s, and move its waiting messages?", groupName(*from), *topic, groupName(*to)), *yes)
	}
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		n, err := pgoutbox.RenameGroup(ctx, exec, tables, *topic, *from, *to)
		if err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "renamed group %s of topic %q to %s; moved %d waiting message(s); start the subscribers of %s now\n",
			groupName(*from), *topic, groupName(*to), n, groupName(*to))
		// Rows the old name's running subscribers hold stay with their
		// delivery; one they give back stays under the old name.
		if st, err := pgoutbox.Stats(ctx, exec, tables, pgoutbox.StatsForGroup(*topic, *from)); err == nil && len(st) == 1 && st[0].Leased > 0 {
			fmt.Fprintf(c.stderr, "pgoutbox: note: %d message(s) of group %s are being delivered by its subscribers still running; one they give back stays under the old name: stop them, then run pgoutbox move --topic %s --from %s --to %s\n",
				st[0].Leased, groupName(*from), shellArg(*topic), shellArg(*from), shellArg(*to))
		}
		return nil
	})
}

// shellArg quotes a group for a command line to copy.
func shellArg(s string) string {
	if s == "" || strings.ContainsAny(s, " \t'\"$`\\!*?[]{}()<>|&;#~") {
		return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
	}
	return s
}

func (c *cli) unbindCmd(args []string) error {
	cmd := c.newCommand("unbind", "unbind --topic T [--group G] [--purge [--yes]]   (no --group: the default group; exits 1 when the group was not bound)",
		"  pgoutbox unbind --topic orders.placed --group old-service\n  pgoutbox unbind --topic orders.placed --group old-service --purge --yes\n", false)
	topic, group := topicGroupFlags(cmd)
	purge := cmd.fs.Bool("purge", false, "also delete the group's pending copies (asks for confirmation)")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	confirm := func() error {
		if !*purge {
			return nil
		}
		return c.confirm(cmd.name+" --purge", fmt.Sprintf("Unbind group %s from %q and delete its pending messages?", groupName(*group), *topic), *yes)
	}
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		n, err := pgoutbox.Unbind(ctx, exec, tables, *topic, *group, *purge)
		if errors.Is(err, pgoutbox.ErrNotBound) {
			if *purge && *group == "" && n == 0 {
				return err // a topic no group is bound to keeps its messages: the error says why
			}
			if *purge && n > 0 {
				// The group was unbound already (stranded rows, which stats
				// says to purge this way): the purge is what was asked.
				fmt.Fprintf(c.stdout, "group %s was not bound to topic %q; deleted %d pending message(s)\n", groupName(*group), *topic, n)
				return nil
			}
			if *purge {
				fmt.Fprintf(c.stdout, "deleted %d pending message(s)\n", n)
			}
			return fmt.Errorf("group %s was not bound to topic %q; nothing was unbound (\"pgoutbox stats --topic %s\" lists its groups)", groupName(*group), *topic, *topic)
		}
		if err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "unbound group %s from topic %q", groupName(*group), *topic)
		if *purge {
			fmt.Fprintf(c.stdout, "; deleted %d pending message(s)", n)
		}
		fmt.Fprintln(c.stdout)
		return nil
	})
}

// printStillPublishing warns of publishes that were open across a topic's
// first binding and outlasted the wait for them: what they commit waits
// unbound for the next binding of the topic.
func printStillPublishing(w io.Writer, topic string, ids []string) {
	if len(ids) == 0 {
		return
	}
	fmt.Fprintf(w, "warning: %d transaction(s) publishing to the outbox were still open when the wait for them ended (virtual transaction ids %s in pg_locks, whose pid names each session in pg_stat_activity): "+
		"what they commit is bound to no group yet; run pgoutbox bind --topic %s again once they ended, or start a subscriber of the topic, and it goes to the groups bound\n",
		len(ids), strings.Join(ids, ", "), shellArg(topic))
}
