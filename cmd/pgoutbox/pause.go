package main

import (
	"context"
	"fmt"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// pauseCmd runs "pause" (resume false) or "resume".
func (c *cli) pauseCmd(args []string, resume bool) error {
	name, examples := "pause", "  pgoutbox pause --topic orders.placed --group billing   # billing claims nothing until resumed\n"
	if resume {
		name, examples = "resume", "  pgoutbox resume --topic orders.placed --group billing\n"
	}
	cmd := c.newCommand(name, name+" --topic T [--group G]   (no --group: the default group; a group not bound to the topic is noted on stderr)", examples, false)
	topic, group := topicGroupFlags(cmd)
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		if !resume {
			if err := pgoutbox.PauseGroup(ctx, exec, tables, *topic, *group); err != nil {
				return err
			}
			fmt.Fprintf(c.stdout, "paused group %s of topic %q: its subscribers claim nothing new (messages in flight finish); publishing goes on\n", groupName(*group), *topic)
			c.noteUnbound(ctx, exec, tables, *topic, *group, "the pause holds for when it is bound")
			return nil
		}
		was, err := pgoutbox.ResumeGroup(ctx, exec, tables, *topic, *group)
		if err != nil {
			return err
		}
		if !was {
			fmt.Fprintf(c.stdout, "group %s of topic %q was not paused\n", groupName(*group), *topic)
		} else {
			fmt.Fprintf(c.stdout, "resumed group %s of topic %q: its subscribers were woken\n", groupName(*group), *topic)
		}
		c.noteUnbound(ctx, exec, tables, *topic, *group, "")
		return nil
	})
}

// noteUnbound writes a note to stderr when group is not bound to topic:
// pausing ahead of a deploy is allowed, but a mistyped group or topic
// should show. The check is a courtesy: when the role may not read the
// queues (Stats), nothing is said.
func (c *cli) noteUnbound(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group, more string) {
	st, err := pgoutbox.Stats(ctx, exec, tables, pgoutbox.StatsForGroup(topic, group))
	if err != nil || len(st) != 1 || st[0].Bound {
		return
	}
	if more != "" {
		more = "; " + more
	}
	fmt.Fprintf(c.stderr, "pgoutbox: note: group %s is not bound to topic %q (mistyped?)%s; \"pgoutbox stats --topic %s\" lists the topic's groups\n",
		groupName(group), topic, more, shellArg(topic))
}
