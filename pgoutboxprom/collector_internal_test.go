package pgoutboxprom

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
)

// A session whose time is known has held its snapshot for 30 minutes; a
// replica's hot_standby_feedback (a walsender: no xact_start, whatever the
// role's grants) holds an older xmin. The gauge reports the known 30
// minutes, a lower bound that still trips the 10-minute alert, rather than
// nothing.
func TestKnownSnapshotAgeIsReportedBesideAnUntimedHolder(t *testing.T) {
	c := NewCollector(nil, schema.Config{Table: "outbox"}, Options{})
	since := time.Now().Add(-30 * time.Minute)
	h := pgoutbox.HealthReport{SnapshotHolders: []pgoutbox.SnapshotHolder{
		{Kind: pgoutbox.SnapshotBackend, XminAge: 60000, BackendType: "walsender"},
		{Kind: pgoutbox.SnapshotBackend, XminAge: 50000, Since: since, Age: 30 * time.Minute, State: "idle in transaction"},
	}}
	ch := make(chan prometheus.Metric, 100)
	c.collectHealth(ch, h)
	close(ch)
	var got []float64
	for m := range ch {
		if m.Desc() != c.snapshotAge {
			continue
		}
		var pb dto.Metric
		if err := m.Write(&pb); err != nil {
			t.Fatal(err)
		}
		if pb.GetLabel()[0].GetValue() == KindBackend {
			got = append(got, pb.GetGauge().GetValue())
		}
	}
	if len(got) != 1 || got[0] < 600 {
		t.Fatalf("oldest_snapshot_age_seconds{kind=backend}: %v; want one sample of at least 1800 s (a known 30-minute holder)", got)
	}
}
