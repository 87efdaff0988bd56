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
	cmd := c.newCommand(name, name+" --topic T [--group G]   (no --group: the default group)", examples, false)
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
			return nil
		}
		was, err := pgoutbox.ResumeGroup(ctx, exec, tables, *topic, *group)
		if err != nil {
			return err
		}
		if !was {
			fmt.Fprintf(c.stdout, "group %s of topic %q was not paused\n", groupName(*group), *topic)
			return nil
		}
		fmt.Fprintf(c.stdout, "resumed group %s of topic %q: its subscribers were woken\n", groupName(*group), *topic)
		return nil
	})
}
