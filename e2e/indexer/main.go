// Command indexer runs llm-d's KV-cache indexer (github.com/llm-d/llm-d-kv-cache at the version go.mod pins) as a
// router's peer for kvtier's tests and bench: its ZMQ subscribers read the engines' KV events, its index and its
// longest-prefix scorer answer over HTTP. Nothing here re-implements the library: subscribers, the vLLM event
// adapter, the index and the scorer are the library's own; this file only wires them and serves JSON.
//
//	indexer -listen 127.0.0.1:0 -port-file F -block-size 32 -weights gpu=1,cpu=0.8,storage=0.5
//
// HTTP API (JSON bodies, at most 8 MiB):
//
//	POST /subscribe {"pod": ID, "endpoint": "tcp://IP:PORT"}   dial a pod's publisher (topic filter "kv@")
//	POST /score {"model": M, "tokens": [...], "pods": [...], "salt": S}
//	     -> {"scores": {pod: score}}                            the library's ScoreTokens: what a router ranks by
//	POST /blocks (same body) -> {"blocks": [[{"pod": ID, "tier": T}, ...], ...]}
//	     the index's entries for each whole block of the prompt, in order (empty where it holds none)
//	GET /healthz
//
// A request's cache salt enters its first block's key as vLLM's own events carry it (an untagged string among the
// block's extra keys, which the library's event parser keeps as the block's extra feature), so a salted prompt is
// scored against salted blocks only.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvcache/kvblock"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents"
	"github.com/llm-d/llm-d-kv-cache/pkg/kvevents/engineadapter"
	"go.uber.org/zap/zapcore"
	"k8s.io/apimachinery/pkg/util/sets"
	ctrllog "sigs.k8s.io/controller-runtime/pkg/log"
	ctrlzap "sigs.k8s.io/controller-runtime/pkg/log/zap"
)

const (
	maxBody   = 8 << 20
	maxTokens = 1 << 20
	maxPods   = 1024
)

type server struct {
	indexer     *kvcache.Indexer
	subscribers *kvevents.SubscriberManager
	blockSize   int
	ctx         context.Context
}

type query struct {
	Model  string   `json:"model"`
	Tokens []uint32 `json:"tokens"`
	Pods   []string `json:"pods"`
	Salt   string   `json:"salt"`
}

type subscription struct {
	Pod      string `json:"pod"`
	Endpoint string `json:"endpoint"`
}

type entry struct {
	Pod  string `json:"pod"`
	Tier string `json:"tier"`
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "HTTP address to serve on")
	portFile := flag.String("port-file", "", "write the HTTP port here once listening")
	blockSize := flag.Int("block-size", 16, "tokens per block: the engines' --block-size")
	hashSeed := flag.String("hash-seed", "", "the engines' PYTHONHASHSEED, if they set one")
	weights := flag.String("weights", "gpu=1,cpu=0.8,storage=0.5", "scoring weight per medium (device tier)")
	concurrency := flag.Int("concurrency", 4, "event-processing workers")
	verbose := flag.Bool("v", false, "log the library's info messages too (default: its errors and warnings only)")
	flag.Parse()
	// The library logs through controller-runtime's logger: without one set, its first use prints a stack trace
	// and every message after it is dropped, errors included (a subscriber that cannot connect, an event batch
	// it cannot parse), which a failed test then cannot show.
	level := zapcore.WarnLevel
	if *verbose {
		level = zapcore.InfoLevel
	}
	ctrllog.SetLogger(ctrlzap.New(ctrlzap.Level(level), ctrlzap.WriteTo(os.Stderr)))
	if err := run(*listen, *portFile, *blockSize, *hashSeed, *weights, *concurrency); err != nil {
		log.Fatalf("indexer: %v", err)
	}
}

func parseWeights(text string) ([]*kvcache.KVCacheBackendConfig, error) {
	var out []*kvcache.KVCacheBackendConfig
	for _, part := range strings.Split(text, ",") {
		name, value, ok := strings.Cut(strings.TrimSpace(part), "=")
		weight, err := strconv.ParseFloat(value, 64)
		if !ok || name == "" || err != nil || weight < 0 {
			return nil, fmt.Errorf("-weights: %q must be medium=weight (a non-negative number)", part)
		}
		out = append(out, &kvcache.KVCacheBackendConfig{Name: strings.ToLower(name), Weight: weight})
	}
	return out, nil
}

func run(listen, portFile string, blockSize int, hashSeed, weightText string, concurrency int) error {
	if blockSize < 1 || blockSize > 4096 {
		return fmt.Errorf("-block-size: %d must be between 1 and 4096", blockSize)
	}
	backends, err := parseWeights(weightText)
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()

	tokens := &kvblock.TokenProcessorConfig{BlockSizeTokens: blockSize, HashSeed: hashSeed}
	processor, err := kvblock.NewChunkedTokenDatabase(tokens)
	if err != nil {
		return err
	}
	config, err := kvcache.NewDefaultConfig()
	if err != nil {
		return err
	}
	config.BackendConfigs = backends
	indexer, err := kvcache.NewKVCacheIndexer(ctx, config, processor)
	if err != nil {
		return err
	}
	go indexer.Run(ctx)

	pool := kvevents.NewPool(&kvevents.Config{TopicFilter: "kv@", Concurrency: concurrency},
		indexer.KVBlockIndex(), processor, engineadapter.NewVLLMAdapter())
	pool.Start(ctx)
	defer pool.Shutdown(context.Background())
	subscribers := kvevents.NewSubscriberManager(pool)
	defer subscribers.Shutdown(context.Background())

	s := &server{indexer: indexer, subscribers: subscribers, blockSize: blockSize, ctx: ctx}
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.HandleFunc("/subscribe", s.subscribe)
	mux.HandleFunc("/score", s.score)
	mux.HandleFunc("/blocks", s.blocks)

	listener, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	port := listener.Addr().(*net.TCPAddr).Port
	if portFile != "" {
		if err := os.WriteFile(portFile+".tmp", []byte(strconv.Itoa(port)+"\n"), 0o644); err != nil {
			return err
		}
		if err := os.Rename(portFile+".tmp", portFile); err != nil {
			return err
		}
	}
	log.Printf("indexer: llm-d-kv-cache index on %s (block size %d, weights %s)", listener.Addr(), blockSize, weightText)
	httpServer := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = httpServer.Shutdown(shutdown)
	}()
	if err := httpServer.Serve(listener); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

func decode(w http.ResponseWriter, r *http.Request, into any) bool {
	if r.Method != http.MethodPost {
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return false
	}
	body := http.MaxBytesReader(w, r.Body, maxBody)
	if err := json.NewDecoder(body).Decode(into); err != nil {
		http.Error(w, "body: "+err.Error(), http.StatusBadRequest)
		return false
	}
	return true
}

func reply(w http.ResponseWriter, value any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(value)
}

func (s *server) subscribe(w http.ResponseWriter, r *http.Request) {
	var sub subscription
	if !decode(w, r, &sub) {
		return
	}
	if sub.Pod == "" || !strings.HasPrefix(sub.Endpoint, "tcp://") {
		http.Error(w, "pod: must be set; endpoint: must be tcp://HOST:PORT", http.StatusBadRequest)
		return
	}
	if err := s.subscribers.EnsureSubscriber(s.ctx, sub.Pod, sub.Endpoint, "kv@", true); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	reply(w, map[string]string{"subscribed": sub.Pod})
}

// features is the salt as the first block's extra feature (vLLM's events carry it so), nil without one.
func (s *server) features(q *query) []*kvblock.BlockExtraFeatures {
	n := len(q.Tokens) / s.blockSize
	if q.Salt == "" || n == 0 {
		return nil
	}
	out := make([]*kvblock.BlockExtraFeatures, n)
	out[0] = &kvblock.BlockExtraFeatures{MMHashes: []kvblock.MMHash{{Hash: q.Salt}}}
	return out
}

func (s *server) checked(w http.ResponseWriter, r *http.Request) (*query, bool) {
	var q query
	if !decode(w, r, &q) {
		return nil, false
	}
	if q.Model == "" || len(q.Tokens) > maxTokens || len(q.Pods) > maxPods {
		http.Error(w, fmt.Sprintf("model: must be set; tokens: at most %d; pods: at most %d", maxTokens, maxPods),
			http.StatusBadRequest)
		return nil, false
	}
	return &q, true
}

func (s *server) score(w http.ResponseWriter, r *http.Request) {
	q, ok := s.checked(w, r)
	if !ok {
		return
	}
	scores, err := s.indexer.ScoreTokens(r.Context(), q.Tokens, q.Model, q.Pods, s.features(q))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	if scores == nil {
		scores = map[string]float64{}
	}
	reply(w, map[string]any{"scores": scores})
}

func (s *server) blocks(w http.ResponseWriter, r *http.Request) {
	q, ok := s.checked(w, r)
	if !ok {
		return
	}
	keys, err := s.indexer.ComputeBlockKeysFromTokens(r.Context(), q.Tokens, q.Model, s.features(q))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	out := make([][]entry, len(keys))
	if len(keys) > 0 {
		found, err := s.indexer.KVBlockIndex().Lookup(r.Context(), keys, sets.New(q.Pods...))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		for i, key := range keys {
			out[i] = []entry{}
			for _, e := range found[key] {
				out[i] = append(out[i], entry{Pod: e.PodIdentifier, Tier: e.DeviceTier})
			}
		}
	}
	reply(w, map[string]any{"blocks": out})
}
