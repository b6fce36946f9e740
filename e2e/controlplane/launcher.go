package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	apiserverapp "k8s.io/kubernetes/cmd/kube-apiserver/app"

	"kvtier.io/e2e/controlplane/internal/owner"
)

const (
	serviceClusterIPRange = "10.96.0.0/16"
	serviceClusterIP      = "10.96.0.1" // first address of the range: the "kubernetes" Service
	serviceAccountIssuer  = "https://kubernetes.default.svc.cluster.local"
	adminUser             = "kvtier-admin"
	readyTimeout          = 180 * time.Second
	// apiserverDrain bounds the API server's graceful shutdown; `run stop` allows 30s for the whole stop.
	apiserverDrain = 10 * time.Second
)

// layout names the files of one control plane under its directory.
type layout struct{ dir string }

func (l layout) path(name string) string { return filepath.Join(l.dir, name) }
func (l layout) pki(name string) string  { return filepath.Join(l.dir, "pki", name) }
func (l layout) etcdData() string        { return l.path("etcd") }
func (l layout) kubeconfig() string      { return l.path("kubeconfig") }
func (l layout) ready() string           { return l.path("ready") }

// ports holds the loopback ports of one run, chosen free just before use.
type ports struct{ etcdClient, etcdPeer, apiserver int }

func runUp(args []string) int {
	fs := flag.NewFlagSet("up", flag.ContinueOnError)
	dir := fs.String("dir", "", "directory for data, certificates, logs and the kubeconfig (required)")
	ownerPID := fs.Int("owner-pid", 0, "exit when this process exits (0: run until SIGTERM)")
	withKCM := fs.Bool("controller-manager", true, "also run kube-controller-manager")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "kvtier-controlplane up: --dir is required")
		return 2
	}
	if err := up(*dir, *ownerPID, *withKCM); err != nil {
		fmt.Fprintln(os.Stderr, "kvtier-controlplane up:", err)
		return 1
	}
	return 0
}

func up(dir string, ownerPID int, withKCM bool) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	l := layout{dir: abs}
	if ownerPID > 0 {
		o, err := owner.Of(ownerPID)
		if err != nil {
			return err
		}
		owner.Watch(o)
	}
	// Built first: it installs the SIGTERM/SIGINT handler whose context ends the whole run.
	apiserverCmd := apiserverapp.NewAPIServerCommand()
	ctx := apiserverCmd.Context()

	// Every start is a fresh cluster: tests must not see objects from an earlier run.
	for _, stale := range []string{l.ready(), l.kubeconfig(), l.etcdData(), l.path("pki")} {
		if err := os.RemoveAll(stale); err != nil {
			return err
		}
	}
	if err := os.MkdirAll(l.path("pki"), 0o700); err != nil {
		return err
	}
	p, err := freePorts()
	if err != nil {
		return err
	}
	etcd, err := startEtcd(l, p)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	stopped := false
	defer func() {
		if !stopped {
			closeEtcd(etcd, 5*time.Second)
		}
	}()

	admin, err := writePKI(l)
	if err != nil {
		return fmt.Errorf("certificates: %w", err)
	}
	server := fmt.Sprintf("https://127.0.0.1:%d", p.apiserver)
	if err := writeKubeconfig(l.kubeconfig(), server, admin); err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}

	apiserverCmd.SetArgs(apiserverArgs(l, p))
	apiserverDone := make(chan error, 1)
	go func() { apiserverDone <- apiserverCmd.Execute() }()
	go func() {
		// etcd failing under a running API server leaves nothing worth keeping: stop everything.
		if err, ok := <-etcd.Err(); ok && err != nil {
			fmt.Fprintln(os.Stderr, "kvtier-controlplane: etcd failed:", err)
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		}
	}()

	if err := waitReady(ctx, server, admin, apiserverDone); err != nil {
		return err
	}
	var kcm *child
	if withKCM {
		if kcm, err = startControllerManager(l); err != nil {
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
			<-apiserverDone
			return fmt.Errorf("kube-controller-manager: %w", err)
		}
	}
	if err := os.WriteFile(l.ready(), []byte(server+"\n"), 0o644); err != nil {
		return err
	}
	fmt.Printf("kvtier-controlplane: ready at %s; kubeconfig %s\n", server, l.kubeconfig())

	select {
	case err = <-apiserverDone: // it failed by itself
	case <-ctx.Done():
		_ = os.Remove(l.ready())
		// The controller manager goes first: the API server's graceful shutdown waits for open connections,
		// and the controller manager's watches would hold it for the full request timeout (60s).
		kcm.stop(5 * time.Second)
		select {
		case err = <-apiserverDone:
		case <-time.After(apiserverDrain):
			fmt.Fprintf(os.Stderr, "kvtier-controlplane: API server still draining after %s (a client kept a watch open); exiting anyway\n", apiserverDrain)
		}
	}
	_ = os.Remove(l.ready())
	kcm.stop(5 * time.Second)
	stopped = true
	closeEtcd(etcd, 5*time.Second)
	fmt.Println("kvtier-controlplane: stopped")
	return err
}

// closeEtcd stops etcd, giving up after timeout: its graceful stop waits for clients that may never leave.
func closeEtcd(e *embed.Etcd, timeout time.Duration) {
	done := make(chan struct{})
	go func() {
		e.Close()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(timeout):
		fmt.Fprintf(os.Stderr, "kvtier-controlplane: etcd did not close within %s; exiting anyway\n", timeout)
	}
}

// freePorts asks the kernel for three distinct free loopback ports. They are released before use, so another
// process may take one in between; `run start` retries a start that failed that way.
func freePorts() (ports, error) {
	var listeners []net.Listener
	defer func() {
		for _, ln := range listeners {
			_ = ln.Close()
		}
	}()
	var got []int
	for range 3 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return ports{}, err
		}
		listeners = append(listeners, ln)
		got = append(got, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports{etcdClient: got[0], etcdPeer: got[1], apiserver: got[2]}, nil
}

func startEtcd(l layout, p ports) (*embed.Etcd, error) {
	cfg := embed.NewConfig()
	cfg.Name = "kvtier"
	cfg.Dir = l.etcdData()
	client := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(p.etcdClient))}
	peer := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(p.etcdPeer))}
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	cfg.LogOutputs = []string{l.path("etcd.log")}
	// A test cluster is thrown away after the run; fsync on every write only costs time.
	cfg.UnsafeNoFsync = true
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, errors.New("not ready after 60s; see etcd.log")
	}
}

func writePKI(l layout) (issued, error) {
	ca, err := newPKI()
	if err != nil {
		return issued{}, err
	}
	serving, err := ca.serving()
	if err != nil {
		return issued{}, err
	}
	admin, err := ca.client(adminUser, "system:masters")
	if err != nil {
		return issued{}, err
	}
	saKey, saPub, err := serviceAccountKeys()
	if err != nil {
		return issued{}, err
	}
	err = writeFiles(filepath.Join(l.dir, "pki"), map[string][]byte{
		"ca.crt":        ca.caPEM,
		"apiserver.crt": serving.certPEM,
		"apiserver.key": serving.keyPEM,
		"admin.crt":     admin.certPEM,
		"admin.key":     admin.keyPEM,
		"sa.key":        saKey,
		"sa.pub":        saPub,
	})
	admin.caPEM = ca.caPEM
	return admin, err
}

func apiserverArgs(l layout, p ports) []string {
	return []string{
		"--etcd-servers=" + fmt.Sprintf("http://127.0.0.1:%d", p.etcdClient),
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(p.apiserver),
		"--cert-dir=" + l.path("pki"),
		"--tls-cert-file=" + l.pki("apiserver.crt"),
		"--tls-private-key-file=" + l.pki("apiserver.key"),
		// Authentication: client certificates from our CA (the admin kubeconfig) and service-account tokens.
		"--client-ca-file=" + l.pki("ca.crt"),
		"--service-account-issuer=" + serviceAccountIssuer,
		"--service-account-key-file=" + l.pki("sa.pub"),
		"--service-account-signing-key-file=" + l.pki("sa.key"),
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=" + serviceClusterIPRange,
		// The endpoint reconciler refuses a loopback advertise address. Pods on a node (e2e/node) reach the
		// "kubernetes" Service through that node's own NAT rule to this loopback port, not through Endpoints.
		"--endpoint-reconciler-type=none",
		// A node (e2e/node) is named kvtier-node, which no resolver knows; reach its kubelet (logs, exec,
		// port-forward) at its InternalIP, the address of its bridge on this host.
		"--kubelet-preferred-address-types=InternalIP,Hostname",
		"--profiling=false",
	}
}

func controllerManagerArgs(l layout) []string {
	return []string{
		"--kubeconfig=" + l.kubeconfig(),
		"--root-ca-file=" + l.pki("ca.crt"),
	}
}

// child is a process this launcher started; done closes once it has been reaped.
type child struct {
	cmd  *exec.Cmd
	done chan struct{}
}

// startControllerManager runs the controller manager (controllers.go) as a child process of this binary: its
// controllers register the same process-global metrics as the API server, so it cannot share the process. Pdeathsig and the owner
// watch both end it when this process ends, however this process ends.
func startControllerManager(l layout) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	logFile, err := os.OpenFile(l.path("kube-controller-manager.log"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return nil, err
	}
	me, err := owner.Of(os.Getpid())
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(self, append([]string{"kube-controller-manager"}, controllerManagerArgs(l)...)...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.Env = append(os.Environ(), owner.Env+"="+me.String())
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, err
	}
	c := &child{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logFile.Close()
		close(c.done)
	}()
	return c, nil
}

// stop asks the child to exit and kills it if it has not after grace. A nil child is a no-op.
func (c *child) stop(grace time.Duration) {
	if c == nil {
		return
	}
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(grace):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// waitReady polls /readyz as the admin until it answers 200, the API server exits, or the run is cancelled.
func waitReady(ctx context.Context, server string, admin issued, apiserverDone <-chan error) error {
	client, err := adminHTTPClient(admin)
	if err != nil {
		return err
	}
	deadline := time.Now().Add(readyTimeout)
	last := "no answer yet"
	for time.Now().Before(deadline) {
		select {
		case err := <-apiserverDone:
			return fmt.Errorf("kube-apiserver exited before it was ready: %v", err)
		case <-ctx.Done():
			return errors.New("stopped before the API server was ready")
		case <-time.After(250 * time.Millisecond):
		}
		resp, err := client.Get(server + "/readyz")
		if err != nil {
			last = err.Error()
			continue
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return nil
		}
		last = resp.Status
	}
	return fmt.Errorf("kube-apiserver /readyz not ok after %s (last: %s)", readyTimeout, last)
}

func adminHTTPClient(admin issued) (*http.Client, error) {
	cert, err := tls.X509KeyPair(admin.certPEM, admin.keyPEM)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(admin.caPEM) {
		return nil, errors.New("bad CA certificate")
	}
	return &http.Client{
		Timeout: 5 * time.Second,
		Transport: &http.Transport{
			TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{cert}},
		},
	}, nil
}
