package notifier

import (
	"maps"
	"slices"
)

// lockChecks keeps the liveness keys held at the last OrphanChecks checks,
// newest first: a key missing from all of them (and not this process's own)
// belongs to a process that is gone.
type lockChecks struct {
	held []map[int64]bool
}

// add records one check's held keys. gone: a key held before the last
// OrphanChecks checks is missing from all of them (its rows became
// orphans); vanished: a key held at the check before is missing from this
// one (its holder may have died).
func (c *lockChecks) add(now map[int64]bool, own map[int64]bool) (gone, vanished bool) {
	if len(c.held) > 0 {
		for k := range c.held[0] {
			if !now[k] && !own[k] {
				vanished = true
			}
		}
	}
	if len(c.held) == OrphanChecks {
		oldest := c.held[OrphanChecks-1]
		for k := range oldest {
			if !own[k] && !now[k] && !slices.ContainsFunc(c.held[:OrphanChecks-1], func(h map[int64]bool) bool { return h[k] }) {
				gone = true
			}
		}
		c.held = c.held[:OrphanChecks-1]
	}
	c.held = slices.Insert(c.held, 0, maps.Clone(now))
	return gone, vanished
}

// spare returns own and every key held at the last OrphanChecks checks; ok
// is false until that many checks were made.
func (c *lockChecks) spare(own map[int64]bool) (keys []int64, ok bool) {
	if len(c.held) < OrphanChecks {
		return nil, false
	}
	set := maps.Clone(own)
	for _, h := range c.held {
		maps.Copy(set, h)
	}
	return slices.Collect(maps.Keys(set)), true
}
