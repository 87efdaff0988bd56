package pgoutboxui

import (
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/dbclock"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// overviewRow is one topic and group of the overview.
type overviewRow struct {
	Topic, Group                      string
	GroupURL                          string
	Ready, Scheduled, Leased, Expired int64
	Parked, Dead                      int64
	Oldest                            string
	OldestWarn                        bool
	In, Out, Net                      string
	Stranded, Waiting, Paused         bool
	Spark                             spark
}

type overviewData struct {
	Rows        []overviewRow
	Charts      []chart
	SampledAt   string
	SampledAgo  string
	SampleCost  string
	Interval    string
	Err         string
	Stranded    int
	Paused      int
	Observer    bool
	DeadLetters bool
	TotalReady  int64
	TotalDead   int64
}

func (ui *UI) groupURL(topic, group string) string {
	return ui.opts.BasePath + "group?" + url.Values{"topic": {topic}, "group": {group}}.Encode()
}

func (ui *UI) overview(w http.ResponseWriter, r *http.Request) error {
	ui.waitFirstSample(r.Context())
	snap := ui.samp.snapshot(true)
	d := overviewData{Observer: snap.wiredAcks, DeadLetters: ui.names.QDLQ != "", Interval: ui.opts.SampleInterval.String()}
	if snap.err != nil {
		d.Err = snap.err.Error()
	}
	if !snap.at.IsZero() {
		d.SampledAt = snap.at.UTC().Format("15:04:05 UTC")
		d.SampledAgo = ageString(time.Since(snap.at))
		d.SampleCost = snap.cost.Round(time.Millisecond).String()
	}
	topicBound := map[string]bool{}
	for p := range snap.bound {
		topicBound[p.topic] = true
	}
	for _, s := range snap.stats {
		p := pair{s.Topic, s.ConsumerGroup}
		// Rows of a group without a binding: the default group's wait
		// for the first groups to bind while the topic has none (they
		// adopt them); any other's are stranded, whether or not the
		// topic has other groups (a binding hands them to nobody).
		unbound := !snap.bound[p] && s.Ready+s.Scheduled+s.Leased+s.ExpiredLeases+s.Parked > 0
		waiting := unbound && waitsForFirstBinding(s.ConsumerGroup, topicBound[s.Topic])
		row := overviewRow{Topic: s.Topic, Group: s.ConsumerGroup, GroupURL: ui.groupURL(s.Topic, s.ConsumerGroup),
			Ready: s.Ready, Scheduled: s.Scheduled, Leased: s.Leased, Expired: s.ExpiredLeases, Parked: s.Parked,
			Oldest: ageString(s.OldestReadyAge), OldestWarn: s.OldestReadyAge > time.Minute,
			Stranded: unbound && !waiting, Waiting: waiting, Paused: s.Paused,
			In: "-", Out: "-", Net: "-"}
		for _, n := range s.DeadLetters {
			row.Dead += n
		}
		ss := snap.series[p]
		if v, ok := rate(ss, sample.depth); ok {
			row.Net = signedRate(v)
		}
		if v, ok := rate(ss, func(s sample) int64 { return s.acked }); ok && snap.wiredAcks {
			row.Out = perSec(max(v, 0))
		}
		if v, ok := rate(ss, func(s sample) int64 { return s.published }); ok && snap.wiredPublishes && snap.bound[p] {
			row.In = perSec(max(v, 0))
		}
		row.Spark = newSpark(gauge(ss, func(s sample) float64 { return float64(s.depth()) }))
		if row.Stranded {
			d.Stranded++
		}
		if row.Paused {
			d.Paused++
		}
		d.TotalReady += s.Ready
		d.TotalDead += row.Dead
		d.Rows = append(d.Rows, row)
	}
	total := snap.whole
	d.Charts = []chart{
		newChart("Depth (ready + scheduled + leased)", "messages", gauge(total, func(s sample) float64 { return float64(s.depth()) }), count),
		newChart("Oldest ready message", "age", gauge(total, func(s sample) float64 { return float64(s.oldestMS) / 1000 }), seconds),
		// Deletes minus dead-letter inserts: acks of every process.
		newChart("Acked/s (all processes)", "per second", perSecond(snap.totals, func(s sample) int64 { return s.scheduled - s.dead }), perSec),
		newChart("Dead-lettered/s", "per second", perSecond(snap.totals, func(s sample) int64 { return s.dead }), perSec),
	}
	if ui.names.QDLQ == "" {
		d.Charts[3] = newChart("Parked", "messages", gauge(total, func(s sample) float64 { return float64(s.parked) }), count)
	}
	return ui.render(w, r, "overview", "Overview", d)
}

func signedRate(v float64) string {
	if v > 0 {
		return "+" + perSec(v)
	}
	if v < 0 {
		return "−" + perSec(-v)
	}
	return "0/s"
}

type groupData struct {
	Topic, Group string
	Stats        pgoutbox.QueueStats
	Dead         int64
	Bound        bool
	TopicBound   bool // some group is bound to the topic
	Waiting      bool // the default group of a topic no group is bound to: the first groups to bind adopt its rows
	Charts       []chart
	Pending      []pendingView
	Blocked      []blockedKey
	BlockedMin   int
	PeekLimit    int
	DeadURL      string
	Observer     bool
	PausedAt     string
	Self         string
}

type pendingView struct {
	pgoutbox.PendingMessage
	Due      string
	State    string
	Preview  string
	Payload  payloadView
	Metadata []kv
}

type kv struct{ K, V string }

func sortedMetadata(md map[string]string) []kv {
	out := make([]kv, 0, len(md))
	for k, v := range md {
		out = append(out, kv{k, v})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].K < out[j].K })
	return out
}

const peekLimit = 50

func (ui *UI) groupPage(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	topic, group := q.Get("topic"), q.Get("group")
	if topic == "" {
		return badRequest("no topic given; open a topic from the overview")
	}
	ctx := r.Context()
	ui.Start()
	stats, err := pgoutbox.Stats(ctx, ui.exec, ui.tables, pgoutbox.StatsForGroup(topic, group))
	if err != nil {
		return err
	}
	d := groupData{Topic: topic, Group: group, Stats: stats[0], BlockedMin: ui.opts.BlockedDeliveries, PeekLimit: peekLimit,
		Self: ui.groupURL(topic, group)}
	for _, n := range d.Stats.DeadLetters {
		d.Dead += n
	}
	if d.Stats.Paused {
		d.PausedAt = d.Stats.PausedAt.UTC().Format(time.RFC3339)
	}
	bound, err := ui.bindings(ctx)
	if err != nil {
		return err
	}
	d.Bound = bound[pair{topic, group}]
	for p := range bound {
		d.TopicBound = d.TopicBound || p.topic == topic
	}
	d.Waiting = !d.Bound && waitsForFirstBinding(group, d.TopicBound)
	if ui.names.QDLQ != "" {
		d.DeadURL = ui.opts.BasePath + "dead-letters?" + url.Values{"topic": {topic}, "gmode": {"is"}, "group": {group}}.Encode()
	}
	pending, err := pgoutbox.Peek(ctx, ui.exec, ui.tables, topic, group, peekLimit, pgoutbox.PeekPayloadPrefix(listPayloadPrefix))
	if err != nil {
		return err
	}
	// Due times are the database's: a row is ready by its clock, which
	// this machine's may be minutes off.
	now, err := dbclock.Now(ctx, ui.exec)
	if err != nil {
		return err
	}
	for _, m := range pending {
		v := pendingView{PendingMessage: m, Preview: preview(m.Payload, m.PayloadSize), Payload: viewPayload(m.Payload, m.PayloadSize), Metadata: sortedMetadata(m.Metadata)}
		switch {
		case m.Parked:
			v.State, v.Due = "parked", "never (parked)"
		case m.AvailableAt.After(now):
			v.State, v.Due = "scheduled", "in "+ageString(m.AvailableAt.Sub(now))
		default:
			v.State, v.Due = "ready", ageString(now.Sub(m.AvailableAt))+" ago"
		}
		d.Pending = append(d.Pending, v)
	}
	if d.Blocked, err = ui.blockedKeys(ctx, topic, group, 20); err != nil {
		return err
	}
	snap := ui.samp.snapshot(false, pair{topic, group})
	d.Observer = snap.wiredAcks
	ss := snap.series[pair{topic, group}]
	out := newChart("Acked/s", "per second", perSecond(ss, func(s sample) int64 { return s.acked }), perSec)
	if !snap.wiredAcks {
		// Without an Observer: the backlog's fall, a lower bound of the acks.
		out = newChart("Drained/s (depth fall)", "per second", perSecond(ss, func(s sample) int64 { return -s.depth() }), perSec)
	}
	d.Charts = []chart{
		newChart("Depth (ready + scheduled + leased)", "messages", gauge(ss, func(s sample) float64 { return float64(s.depth()) }), count),
		newChart("Oldest ready message", "age", gauge(ss, func(s sample) float64 { return float64(s.oldestMS) / 1000 }), seconds),
		out,
		newChart("Dead-lettered/s", "per second", perSecond(ss, func(s sample) int64 { return s.dead }), perSec),
	}
	title := topic + " · " + groupLabel(group)
	return ui.render(w, r, "group", title, d)
}

// waitsForFirstBinding reports whether the rows of an unbound group wait
// for a binding that takes them: the default group's, while no group is
// bound to the topic (the first groups to bind adopt them). Any other
// unbound group's rows are stranded.
func waitsForFirstBinding(group string, topicBound bool) bool { return group == "" && !topicBound }

func groupLabel(g string) string {
	if g == "" {
		return "(default)"
	}
	return g
}

// dlFilter is the dead-letter filter of a request's form or query.
type dlFilter struct {
	Topic, GroupMode, Group, Reason string
	After, Before                   string // datetime-local, UTC
	f                               pgoutbox.DeadLetterFilter
}

const timeForm = "2006-01-02T15:04"

func parseFilter(v url.Values) (dlFilter, error) {
	// The topic as given: a topic may begin or end with a space, and a
	// trimmed one would name another topic.
	d := dlFilter{Topic: v.Get("topic"), GroupMode: v.Get("gmode"), Group: v.Get("group"),
		Reason: strings.TrimSpace(v.Get("reason")), After: v.Get("after"), Before: v.Get("before")}
	d.f.Topic, d.f.Reason = d.Topic, d.Reason
	// Checked here, not only where the rows are read: a confirmation of
	// a requeue by a reason no dead letter can have offered to requeue
	// "0 rows", which its Confirm then refused.
	if reasons := []string{pgoutbox.ReasonMaxDeliveries, pgoutbox.ReasonRetryExhausted, pgoutbox.ReasonRejected, pgoutbox.ReasonPoisoned}; d.Reason != "" && !slices.Contains(reasons, d.Reason) {
		return d, badRequest("%q is not a failure reason; use one of %s", d.Reason, strings.Join(reasons, ", "))
	}
	switch d.GroupMode {
	case "is":
		g := d.Group
		d.f.ConsumerGroup = &g
	case "", "any":
		d.GroupMode, d.Group = "any", ""
	default:
		return d, badRequest("group mode %q is neither any nor is; choose one (is, with the group's name, empty for the default group)", d.GroupMode)
	}
	for _, t := range []struct {
		s   string
		dst *time.Time
		nm  string
	}{{d.After, &d.f.FailedAfter, "after"}, {d.Before, &d.f.FailedBefore, "before"}} {
		if t.s == "" {
			continue
		}
		tm, err := time.ParseInLocation(timeForm, t.s, time.UTC)
		if err != nil {
			if tm, err = time.Parse(time.RFC3339, t.s); err != nil {
				return d, badRequest("%s %q is not a time like 2026-01-02T15:04 (UTC)", t.nm, t.s)
			}
		}
		*t.dst = tm
	}
	return d, nil
}

func (d dlFilter) values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set("topic", d.Topic)
	if d.GroupMode == "is" {
		v.Set("gmode", "is")
		v.Set("group", d.Group)
	}
	set("reason", d.Reason)
	set("after", d.After)
	set("before", d.Before)
	return v
}

type deadLettersData struct {
	Filter   dlFilter
	Hidden   []kv
	Letters  []dlRow
	NextURL  string
	FirstURL string
	Paged    bool
	Reasons  []string
	Matching int64
	Limit    int
	Return   string
}

type dlRow struct {
	pgoutbox.DeadLetter
	URL      string
	GroupURL string
	Failed   string
	Preview  string
	ShortErr string
}

const deadLetterPageSize = 50

func (ui *UI) deadLettersPage(w http.ResponseWriter, r *http.Request) error {
	if ui.names.QDLQ == "" {
		return badRequest("this outbox has no dead-letter table: failed messages are parked in the outbox; open their topic and group from the overview")
	}
	q := r.URL.Query()
	f, err := parseFilter(q)
	if err != nil {
		return err
	}
	filter := f.f
	filter.Limit = deadLetterPageSize
	filter.PayloadPrefix = previewPrefix
	if at := q.Get("cursor_at"); at != "" {
		t, err := time.Parse(time.RFC3339Nano, at)
		id, err2 := strconv.ParseInt(q.Get("cursor_id"), 10, 64)
		if err != nil || err2 != nil || id <= 0 {
			return badRequest("the page cursor does not parse; start from the first page")
		}
		filter.After = pgoutbox.DeadLetterCursor{FailedAt: t, ID: id}
	}
	page, err := pgoutbox.DeadLetters(r.Context(), ui.exec, ui.tables, filter)
	if err != nil {
		return err
	}
	d := deadLettersData{Filter: f, Limit: deadLetterPageSize, Paged: !filter.After.IsZero(),
		Reasons: []string{pgoutbox.ReasonMaxDeliveries, pgoutbox.ReasonRetryExhausted, pgoutbox.ReasonRejected, pgoutbox.ReasonPoisoned}}
	for k, vs := range f.values() {
		d.Hidden = append(d.Hidden, kv{k, vs[0]})
	}
	sort.Slice(d.Hidden, func(i, j int) bool { return d.Hidden[i].K < d.Hidden[j].K })
	base := f.values()
	d.FirstURL = ui.opts.BasePath + "dead-letters?" + base.Encode()
	d.Return = r.URL.RequestURI()
	if !page.Next.IsZero() {
		next := f.values()
		next.Set("cursor_at", page.Next.FailedAt.UTC().Format(time.RFC3339Nano))
		next.Set("cursor_id", strconv.FormatInt(page.Next.ID, 10))
		d.NextURL = ui.opts.BasePath + "dead-letters?" + next.Encode()
	}
	for _, l := range page.Letters {
		d.Letters = append(d.Letters, dlRow{DeadLetter: l, URL: ui.opts.BasePath + "dead-letter?id=" + strconv.FormatInt(l.ID, 10),
			GroupURL: ui.groupURL(l.Topic, l.ConsumerGroup),
			Failed:   l.FailedAt.UTC().Format("2006-01-02 15:04:05"), Preview: preview(l.Payload, l.PayloadSize), ShortErr: oneLine(l.LastError, 100)})
	}
	return ui.render(w, r, "deadletters", "Dead letters", d)
}

func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if len([]rune(s)) > n {
		s = string([]rune(s)[:n-1]) + "…"
	}
	return s
}

type deadLetterData struct {
	L        pgoutbox.DeadLetter
	Payload  payloadView
	Metadata []kv
	GroupURL string
	Created  string
	Failed   string
}

func (ui *UI) deadLetterPage(w http.ResponseWriter, r *http.Request) error {
	given := r.URL.Query().Get("id")
	id, err := strconv.ParseInt(given, 10, 64)
	switch {
	case given == "":
		return badRequest("no dead-letter id given; open one from the dead letters")
	case err != nil || id <= 0:
		return badRequest("dead-letter id %q is not one: ids are whole numbers above 0; open one from the dead letters", given)
	}
	ls, err := ui.deadLettersByID(r.Context(), []int64{id}, 0)
	if err != nil {
		return err
	}
	if len(ls) == 0 {
		return &httpError{code: http.StatusNotFound, msg: "dead letter " + strconv.FormatInt(id, 10) + " is not in the dead-letter table (requeued, deleted or purged)"}
	}
	l := ls[0]
	d := deadLetterData{L: l, Payload: viewPayload(l.Payload, l.PayloadSize), Metadata: sortedMetadata(l.Metadata), GroupURL: ui.groupURL(l.Topic, l.ConsumerGroup),
		Created: l.CreatedAt.UTC().Format(time.RFC3339), Failed: l.FailedAt.UTC().Format(time.RFC3339)}
	return ui.render(w, r, "deadletter", "Dead letter "+strconv.FormatInt(id, 10), d)
}
